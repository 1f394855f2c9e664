"""`clma serve` without a server: what it passes to the flow's serve API, and its refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = Path(__file__).with_name("durable_tiny.toml")
ROOT = Path(__file__).resolve().parents[2]


def test_schedule_and_parameters_from_the_config(tmp_path):
    from flows.serve import deployment_spec

    cfg = tmp_path / "fed.toml"
    cfg.write_text(TINY.read_text() + '\n[schedule]\ninterval_seconds = 900\nrounds_per_run = 3\n')
    _, sdir, name, kw = deployment_spec(str(cfg), str(tmp_path / "st"))
    assert kw["interval"] == 900 and kw["cron"] is None
    assert name == kw["name"] == "durable-tiny" and kw["concurrency_limit"] == 1
    assert kw["paused"] is False and sdir == tmp_path / "st"
    assert kw["parameters"] == {"config_path": str(cfg.resolve()),
                                "state_dir": str((tmp_path / "st").resolve()),
                                "rounds_per_run": 3}


def test_flags_override_the_config_schedule(tmp_path):
    from flows.serve import deployment_spec

    *_, kw = deployment_spec(str(TINY), str(tmp_path / "st"), cron="*/5 * * * *",
                             rounds_per_run=2, name="x")
    assert (kw["cron"], kw["interval"], kw["name"]) == ("*/5 * * * *", None, "x")
    assert kw["parameters"]["rounds_per_run"] == 2
    with pytest.raises(ValueError, match="at most one of cron and interval_seconds"):
        deployment_spec(str(TINY), str(tmp_path / "st"), cron="* * * * *", interval_seconds=60)


def test_default_state_dir_is_state_slash_name(tmp_path, monkeypatch):
    from flows.serve import deployment_spec

    monkeypatch.chdir(tmp_path)
    *_, kw = deployment_spec(str(TINY), None)
    assert kw["parameters"]["state_dir"] == str(tmp_path / "state" / "durable-tiny")


def test_a_second_serve_on_the_same_state_is_refused_naming_the_first(tmp_path, capsys,
                                                                     monkeypatch):
    import socket

    from clma.state import StateStore
    from flows.cli import main

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    with StateStore(tmp_path / "st").serve_lock("clma-scheduled-federation/first") as holder:
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        rc = main(["serve", "--config", str(TINY), "--state-dir", str(tmp_path / "st")])
        err = capsys.readouterr().err
        assert rc == 2
        assert "is already served (deployment 'clma-scheduled-federation/first', " \
               f"pid {os.getpid()} on {socket.gethostname()}, since " in err
        assert "serving deployment" not in err  # refused before anything is registered
    # released on exit: a later serve takes it, and the file no longer names anyone
    assert (tmp_path / "st" / "serve.lock").read_text() == ""
    with StateStore(tmp_path / "st").serve_lock("again"):
        pass


def test_the_serve_lock_is_recovered_after_a_crash(tmp_path):
    import signal

    from clma.state import ServeLocked, StateStore

    code = ("import sys, time; from clma.state import StateStore\n"
            "with StateStore(sys.argv[1]).serve_lock('crashing'):\n"
            "    print('held', flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "st")],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(ServeLocked, match="deployment 'crashing'") as info, \
                StateStore(tmp_path / "st").serve_lock("second"):
            pass
        assert info.value.holder["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # the crashed holder's name is still in the file, but the kernel released its flock
    assert "crashing" in (tmp_path / "st" / "serve.lock").read_text()
    with StateStore(tmp_path / "st").serve_lock("after-crash") as holder:
        assert holder["deployment"] == "after-crash"


def test_serve_on_a_complete_federation_says_so_and_serves_nothing(tmp_path, capsys,
                                                                  monkeypatch):
    import prefect.runner

    import tasks.durable
    from flows import serve
    from flows.cli import main

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setattr(tasks.durable, "state_summary", lambda _: {"round": 4})  # 4 of 4
    paused = []
    monkeypatch.setattr(serve, "_pause_by_name", paused.append)

    def no_runner(*a, **k):
        raise AssertionError("a complete federation must not be served")

    monkeypatch.setattr(prefect.runner, "Runner", no_runner)
    rc = main(["serve", "--config", str(TINY), "--state-dir", str(tmp_path / "st"),
               "--interval", "60"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "federation 'durable-tiny' is complete (all 4 rounds committed" in err
    assert "its deployment stays paused" in err
    assert paused == ["durable-tiny"]  # an un-paused deployment of it is paused again


def test_cli_refusals(monkeypatch, capsys, tmp_path):
    from flows.cli import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["serve", "--config", str(TINY)]) == 2
    assert "PREFECT_API_URL is not set" in capsys.readouterr().err
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert main(["serve", "--config", str(TINY), "--cron", "every hour"]) == 2
    assert "--cron: must have 5" in capsys.readouterr().err
    assert main(["serve", "--config", str(TINY), "--rounds-per-run", "0"]) == 2
    assert "--rounds-per-run: must be a positive integer" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--cron", "0 * * * *", "--interval", "60"])


def test_serve_against_a_prefect_api_that_is_down(tmp_path):
    """A subprocess, as the user runs it (in this process Prefect's settings are already
    loaded): said plainly, exit 2, no traceback, the serve lock released."""
    env = dict(os.environ, PREFECT_API_URL="http://127.0.0.1:9/api",
               PREFECT_HOME=str(tmp_path / "ph"))
    r = subprocess.run([str(Path(sys.executable).with_name("clma")), "serve", "--config",
                        str(TINY), "--state-dir", str(tmp_path / "st")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "clma serve: the Prefect API at http://127.0.0.1:9/api cannot be reached" in r.stderr
    assert "Traceback" not in r.stderr
    assert (tmp_path / "st" / "serve.lock").read_text() == ""


def test_cli_run_state_dir_refusals(tmp_path, capsys):
    from clma.state import StateStore
    from flows.cli import main

    assert main(["run", "--resume", str(tmp_path / "none")]) == 2
    assert "no committed federation state" in capsys.readouterr().err
    StateStore(tmp_path / "st").commit(1, {"federation.json": b"{}"})
    assert main(["run", "--config", str(TINY), "--state-dir", str(tmp_path / "st")]) == 2
    assert "already holds a federation" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path / "st"), "--state-dir", "x"]) == 2
    assert "give one" in capsys.readouterr().err
