"""``clma run`` with an invalid configuration fails before any training: exit code 2 and
one message on stderr naming the field. ``flows.federation`` is replaced by a trap, so a
test fails if the CLI ever got as far as starting the flow."""

from __future__ import annotations

import sys
import types

import pytest

from flows.cli import main


@pytest.fixture(autouse=True)
def flow_trap(monkeypatch):
    trap = types.ModuleType("flows.federation")

    def federation_flow(*args, **kwargs):  # pragma: no cover - reached only on failure
        raise AssertionError("the federation flow started despite an invalid config")

    trap.federation_flow = federation_flow
    monkeypatch.setitem(sys.modules, "flows.federation", trap)
    return trap


def _run(capsys, tmp_path, *argv):
    rc = main(["run", "--out", str(tmp_path / "out"), "--quiet", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _toml(tmp_path, text):
    p = tmp_path / "cfg.toml"
    p.write_text(text)
    return str(p)


CASES = [
    ("rounds = 0\n", "rounds", "greater than 0"),
    ("[training]\nlearning_rate = -0.1\n", "training.learning_rate", "greater than 0"),
    ("[data]\nholdout_fraction = 1.2\n", "data.holdout_fraction", "less than 1"),
    ("[evaluation]\nepsilon = 0\n", "evaluation.epsilon", "greater than 0"),
    ("[cohort]\nvariance_threshold = 1.5\n", "cohort.variance_threshold", "less than or equal"),
    ("typo_field = 3\n", "typo_field", "unknown field"),
    ('name = "bad name!"\n', "name", "letters, digits"),
    ("rounds = 2\n[[drift.events]]\nround = 5\nkind = \"label_rotation\"\nshift = 1\n"
     "family = \"p\"\nclients = [0]\n", "drift.events[0].round", "beyond 'rounds'"),
    ("[[drift.events]]\nround = 1\nkind = \"label_rotation\"\nshift = 0\nfamily = \"p\"\n"
     "clients = [0]\n", "drift.events.0", "non-zero 'shift'"),
    ("rounds = = 1\n", "cfg.toml", "not valid TOML"),
    # data-dependent rules, checked before the flow too
    ("clients = 1000\n", "clients", "at least 2 samples"),
    ("[data]\nprobe_size = 1000\n", "data.probe_size", "smaller than the held-out split"),
    ("[data]\ndataset = \"fashion_mnist\"\ndata_dir = \"/nonexistent/clma\"\n",
     "data.data_dir", "not found"),
    ("[data]\nregion_partition = \"/nonexistent/regions.toml\"\n", "data.region_partition",
     "No such file"),
]


@pytest.mark.parametrize(("text", "field", "rule"), CASES)
def test_invalid_config_file_exit_2_one_message(capsys, tmp_path, text, field, rule):
    rc, out, err = _run(capsys, tmp_path, "--config", _toml(tmp_path, text))
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("clma: ")
    assert "invalid configuration" in lines[0] or "not valid TOML" in lines[0]
    assert field in lines[0] and rule in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--rounds", "0"], "--rounds: must be a positive integer"),
        (["--clients", "-2"], "--clients: must be a positive integer"),
        (["--seed", "-1"], "--seed: must be in [0, 2**32)"),
        (["--seed", str(2**32)], "--seed: must be in [0, 2**32)"),
    ],
)
def test_invalid_overrides_exit_2(capsys, tmp_path, argv, needle):
    rc, out, err = _run(capsys, tmp_path, *argv)
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [f"clma: {needle}"]


def test_missing_config_file(capsys, tmp_path):
    rc, _, err = _run(capsys, tmp_path, "--config", str(tmp_path / "absent.toml"))
    assert rc == 2
    assert "absent.toml" in err and "cannot be read" in err
    assert len(err.strip().splitlines()) == 1


def test_valid_config_reaches_the_flow(tmp_path):
    # control for the trap: a valid config (overrides that drop the default schedule's
    # out-of-range drift events are not an error) does reach the flow, which here raises
    with pytest.raises(AssertionError, match="flow started"):
        main(["run", "--out", str(tmp_path / "o"), "--quiet", "--rounds", "2",
              "--clients", "4"])


def test_argparse_rejects_non_integer(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["run", "--rounds", "many"])
    assert info.value.code == 2
    assert "--rounds" in capsys.readouterr().err
