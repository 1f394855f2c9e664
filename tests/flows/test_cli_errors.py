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
    # non-finite floats, silent coercions, the policy file, a no-op rotation (newcomer trial)
    ("[evaluation]\nloss_max = inf\n", "evaluation.loss_max", "finite number"),
    ("[drift]\ngamma = nan\n", "drift.gamma", "finite number"),
    ("[divergence]\nbeta = inf\n", "divergence.beta", "finite number"),
    ("clients = true\n", "clients", "valid integer"),
    ("[training]\nlearning_rate = true\n", "training.learning_rate", "valid number"),
    ("[model]\nhidden = [100000000]\n", "model.hidden.0", "less than or equal to 4096"),
    ("[budget]\npolicy = \"/nonexistent/policy.toml\"\n", "budget.policy", "cannot be read"),
    ("[[drift.events]]\nround = 2\nkind = \"label_rotation\"\nshift = 10\nfamily = \"p\"\n"
     "clients = [0]\n", "drift.events[0].shift", "changes no label"),
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
    # issue 14 item 6: a refused run leaves no (empty) --out folder behind
    assert not (tmp_path / "out").exists()


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
    assert (tmp_path / "o").is_dir()  # created once every check passed


@pytest.mark.parametrize("argv", [["--clients", "1000"], ["--rounds", "0"]])
def test_refused_run_leaves_no_out_folder(capsys, tmp_path, argv):
    out = tmp_path / "deep" / "out"
    rc = main(["run", "--out", str(out), "--quiet", *argv])
    assert rc == 2 and "clma: " in capsys.readouterr().err
    assert not (tmp_path / "deep").exists()


def test_missing_region_partition_leaves_no_out_folder(capsys, tmp_path):
    cfg = _toml(tmp_path, '[data]\nregion_partition = "/nonexistent/regions.toml"\n')
    rc = main(["run", "--config", cfg, "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 2 and "data.region_partition" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_out_under_a_read_only_folder_fails_before_training(capsys, tmp_path):
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode
            pytest.skip("running as root: permissions are not enforced")
        rc = main(["run", "--out", str(ro / "a" / "b"), "--quiet"])
        err = capsys.readouterr().err
        assert rc == 2 and "--out" in err and "not writable" in err
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


def test_argparse_rejects_non_integer(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["run", "--rounds", "many"])
    assert info.value.code == 2
    assert "--rounds" in capsys.readouterr().err


def test_out_that_is_a_file_fails_before_training(capsys, tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    rc = main(["run", "--out", str(f), "--quiet", "--rounds", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--out" in err and "not a folder" in err and err.count("\n") == 1


def test_resume_rounds_below_committed_and_other_config_refused(capsys, tmp_path, monkeypatch):
    import tasks.durable as durable
    from clma.config import default_config

    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setattr(durable, "state_summary", lambda d: {"round": 2})
    monkeypatch.setattr(durable, "stored_config", lambda d: default_config())
    rc = main(["run", "--resume", str(state), "--rounds", "1", "--quiet",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--rounds 1" in err and "committed 2 rounds" in err
    other = tmp_path / "other.toml"
    other.write_text("seed = 5\n")
    rc = main(["run", "--resume", str(state), "--config", str(other), "--quiet",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("clma: --config: differs from the federation stored")
    # the same refusal as the state's own (clma.state.config_mismatch_message): names only
    from pathlib import Path

    import clma

    text = (Path(clma.__file__).parent / "configs" / "default.toml").read_text()
    assert "\nseed = 0\n" in text
    other.write_text(text.replace("\nseed = 0\n", "\nseed = 7\n"))
    rc = main(["run", "--resume", str(state), "--config", str(other), "--quiet",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "directory at seed (only rounds," in err and "7" not in err


# ------------------------------------------------------------------ experiments' arguments
# Through `clma` itself (flows.cli.main), so the subcommand parser is part of the test: the
# experiments take --experiment (their MLflow experiment), which must not clash with it.


@pytest.mark.parametrize("name", ["atypical-client", "atypical-client-sweep"])
@pytest.mark.parametrize("argv, needle", [
    (["--experiment", "my-mlflow-name", "--rounds", "1"], "--rounds must be >= 2"),
    (["--clients", "2"], "--clients"),
    (["--alphas", "10", "10"], "--alphas must not repeat"),
    (["--perturbations", "blur", "blur"], "--perturbations must not repeat"),
])
def test_experiment_argument_errors_exit_2_before_any_work(capsys, name, argv, needle):
    from flows.cli import main

    assert main(["experiment", name, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["atypical-client", "atypical-client-sweep"])
def test_experiment_out_that_is_a_file_exit_2(capsys, tmp_path, name):
    from flows.cli import main

    f = tmp_path / "file"
    f.write_text("x")
    assert main(["experiment", name, "--out", str(f)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert f.read_text() == "x"


@pytest.mark.parametrize("name, argv", [
    ("atypical-client", ["--seed", "-1"]),
    ("atypical-client-sweep", ["--seeds", "0", "-1"]),
])
def test_experiment_negative_seed_is_a_config_error(capsys, name, argv):
    from flows.cli import main

    assert main(["experiment", name, *argv]) == 2
    assert "seed: Input should be greater than or equal to 0" in capsys.readouterr().err


# ------------------------------------------------------------------ a device install
# `clma[device]` installs the console script without Prefect: every subcommand says which
# install it needs (one line, exit 2) instead of a traceback.


@pytest.mark.parametrize("argv", [["run", "--quiet"], ["approve", "x", "--approver", "a", "--key", "k.pem",
                                   "--reason", "r"],
                                  ["serve"], ["experiment", "atypical-client"]])
def test_without_prefect_names_the_server_extra(capsys, monkeypatch, argv):
    monkeypatch.setitem(sys.modules, "prefect", None)  # find_spec("prefect") -> None
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        f"clma {argv[0]}: needs the server side (Prefect, MLflow), not installed here: "
        "pip install 'clma[server]'"]


def test_a_flower_federation_of_a_users_model_is_checked_before_anything_is_submitted(
        capsys, tmp_path, monkeypatch):
    """The server's side of a deployment (factory, probe file) fails fast: a probe the
    model rejects is refused with exit 2 naming the field, and no Flower run starts."""
    import numpy as np

    import flows.flower_launch

    def no_launch(*args, **kwargs):  # pragma: no cover - reached only on failure
        raise AssertionError("clma run submitted a federation despite a bad probe")

    monkeypatch.setattr(flows.flower_launch, "launch", no_launch)
    pkg = tmp_path / "cliuser"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(
        "from torch import nn\n\ndef mlp():\n"
        "    return nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = tmp_path / "probe.npz"
    np.savez(probe, features=np.zeros((4, 50), np.float32))  # 50 features, the model takes 64
    cfg = _toml(tmp_path, f'[model]\nfactory = "cliuser.model:mlp"\n[data]\nprobe = "{probe}"\n'
                          '[federation]\ntransport = "flower"\n')
    rc, out, err = _run(capsys, tmp_path, "--config", cfg)
    assert rc == 2 and out == ""
    assert err.startswith("clma: invalid configuration: model.factory: the model rejects the "
                          "features of shape (50,) per sample"), err
    assert not (tmp_path / "out").exists()
