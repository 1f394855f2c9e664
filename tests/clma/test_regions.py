"""clma.regions: the bundled versioned partition, sizes, assignment, file errors."""

from __future__ import annotations

import hashlib
from importlib import resources

import pytest

from clma.regions import PartitionError, load_partition

GOOD = """version = "2"
name = "three"
[[regions]]
id = "a"
share = 0.5
neighbour = "b"
[[regions]]
id = "b"
share = 0.3
neighbour = "a"
[[regions]]
id = "c"
share = 0.2
neighbour = "b"
"""


def test_bundled_partition_version_hash_and_regions():
    part = load_partition()
    raw = resources.files("clma.regions").joinpath("regions_v1.toml").read_bytes()
    assert part.version == "1"
    assert part.content_hash == hashlib.sha256(raw).hexdigest()
    assert part.source == "clma/regions/regions_v1.toml"
    assert part.region_ids == ["north", "central", "south", "west", "islands"]
    assert part.neighbours == {"north": "central", "central": "north", "south": "central",
                               "west": "south", "islands": "west"}
    assert sum(r.share for r in part.regions) == pytest.approx(1.0, abs=1e-12)


def test_region_sizes_uneven_with_one_small_region():
    part = load_partition()
    assert part.region_sizes(20) == {"north": 7, "central": 5, "south": 4, "west": 3,
                                     "islands": 1}
    # largest remainder: 0.35*7=2.45, .25*7=1.75, .2*7=1.4, .15*7=1.05, .05*7=.35
    # floors 2,1,1,1,0 (5); the two largest remainders (central .75, north .45) get +1
    assert part.region_sizes(7) == {"north": 3, "central": 2, "south": 1, "west": 1,
                                    "islands": 0}
    for n in (1, 3, 13, 20, 101, 1000):
        sizes = part.region_sizes(n)
        assert sum(sizes.values()) == n
        for r in part.regions:
            assert abs(sizes[r.id] - r.share * n) < 1.0
    with pytest.raises(PartitionError, match="n_clients"):
        part.region_sizes(0)


def test_assign_is_a_seeded_disjoint_cover_with_the_sizes():
    part = load_partition()
    a = part.assign(20, seed=5)
    assert sorted(a) == list(range(20))
    counts: dict[str, int] = {}
    for rid in a.values():
        counts[rid] = counts.get(rid, 0) + 1
    assert counts == part.region_sizes(20)
    assert part.assign(20, seed=5) == a
    assert part.assign(20, seed=6) != a


def test_custom_file_hash_is_of_its_bytes(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text(GOOD)
    part = load_partition(p)
    assert part.version == "2" and part.region_ids == ["a", "b", "c"]
    assert part.content_hash == hashlib.sha256(GOOD.encode()).hexdigest()
    assert part.source == str(p)
    # a comment changes the bytes, hence the recorded hash
    p.write_text(GOOD + "# note\n")
    assert load_partition(p).content_hash != part.content_hash


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (GOOD.replace('share = 0.2', 'share = 0.3'), "shares must sum to 1"),
        (GOOD.replace('id = "c"', 'id = "a"'), "region ids must be unique"),
        (GOOD.replace('neighbour = "b"\n\n', '').replace('id = "c"\nshare = 0.2\nneighbour = "b"',
                                                          'id = "c"\nshare = 0.2\nneighbour = "c"'),
         "regions[c].neighbour must name another region"),
        (GOOD.replace('neighbour = "a"', 'neighbour = "z"'),
         "regions[b].neighbour must name another region"),
        (GOOD.replace('id = "c"', 'id = "C C"'), "regions.2.id"),
        (GOOD.replace('share = 0.5', 'share = 0'), "regions.0.share"),
        (GOOD.replace('version = "2"\n', ''), "version"),
        (GOOD + "colour = 1\n", "colour"),
        ("version = = 1", "not valid TOML"),
    ],
)
def test_bad_partition_files_rejected_naming_the_field(tmp_path, text, needle):
    p = tmp_path / "p.toml"
    p.write_text(text)
    with pytest.raises(PartitionError) as info:
        load_partition(p)
    assert needle in str(info.value)
    assert str(info.value).startswith("region partition ")


def test_missing_partition_file(tmp_path):
    with pytest.raises(PartitionError, match="No such file"):
        load_partition(tmp_path / "nope.toml")
