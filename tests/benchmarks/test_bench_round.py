"""benchmarks/bench_round.py on a tiny federation (no Flower): every step of the round is
timed and printed, the shares add up to the round, the last line has the agreed form;
above ``--shards`` clients the world reuses shards under the clients' own ids."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_round", ROOT / "benchmarks" / "bench_round.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_step_is_timed_and_the_shares_add_up(bench, capsys):
    assert bench.main(["--clients", "12", "--shards", "10", "--rounds-before", "1",
                       "--no-flower"]) == 0
    out = capsys.readouterr().out
    table = re.findall(r"^(\w+)\s+([0-9.]+)\s+([0-9.]+)%", out, re.M)
    seconds = {s: float(t) for s, t, _ in table}
    shares = {s: float(p) for s, _, p in table}
    assert [s for s, _, _ in table] == [*bench.STEPS, "total"]
    assert shares["total"] == 100.0
    assert abs(sum(shares[s] for s in bench.STEPS) - 100.0) <= 1.0
    assert abs(sum(seconds[s] for s in bench.STEPS) - seconds["total"]) <= 0.0005 * len(table)
    assert "releases" in out and "noise seeded: False" in out  # evaluation ran, real noise
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"round 12: total ([0-9.]+) s, slowest (\w+) ([0-9.]+) s, "
                     r"train share ([0-9.]+) %", last)
    assert m and m.group(2) in bench.STEPS
    assert float(m.group(4)) == pytest.approx(shares["train"], abs=0.1)


def test_clients_above_the_shards_reuse_them_under_their_own_ids(bench, tmp_path):
    cfg = bench.bench_config(24, 0, 1, tmp_path / "ledger")
    world = bench.build_world(cfg, 20)
    assert sorted(world.clients) == list(range(24)) and world.config.clients == 24
    for c in (20, 23):
        cl, src = world.clients[c], world.clients[c - 20]
        assert cl.client_id == c and np.array_equal(cl.train_y, src.train_y)
    assert world.region_of() == world.partition.assign(24, 0)
    assert not cfg.divergence.enabled and not cfg.tracking.enabled and not cfg.seeded_noise
    assert cfg.evaluation.every == 2 and bench.bench_config(24, 0, 2, tmp_path).evaluation.every == 3
