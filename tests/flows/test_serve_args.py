"""`clma serve` without a server: what it passes to the flow's serve API, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = Path(__file__).with_name("durable_tiny.toml")


@pytest.fixture
def captured(monkeypatch):
    from flows import serve

    calls = []
    monkeypatch.setattr(serve.scheduled_federation_flow, "serve",
                        lambda **kw: calls.append(kw), raising=False)
    return calls


def test_schedule_and_parameters_from_the_config(tmp_path, captured):
    from flows.serve import serve_federation

    cfg = tmp_path / "fed.toml"
    cfg.write_text(TINY.read_text() + '\n[schedule]\ninterval_seconds = 900\nrounds_per_run = 3\n')
    serve_federation(str(cfg), str(tmp_path / "st"))
    (kw,) = captured
    assert kw["interval"] == 900 and kw["cron"] is None
    assert kw["name"] == "durable-tiny" and kw["limit"] == 1
    assert kw["parameters"] == {"config_path": str(cfg.resolve()),
                                "state_dir": str((tmp_path / "st").resolve()),
                                "rounds_per_run": 3}


def test_flags_override_the_config_schedule(tmp_path, captured):
    from flows.serve import serve_federation

    serve_federation(str(TINY), str(tmp_path / "st"), cron="*/5 * * * *", rounds_per_run=2,
                     name="x")
    (kw,) = captured
    assert (kw["cron"], kw["interval"], kw["name"]) == ("*/5 * * * *", None, "x")
    assert kw["parameters"]["rounds_per_run"] == 2


def test_default_state_dir_is_state_slash_name(tmp_path, monkeypatch, captured):
    from flows.serve import serve_federation

    monkeypatch.chdir(tmp_path)
    serve_federation(str(TINY), None)
    assert captured[0]["parameters"]["state_dir"] == str(tmp_path / "state" / "durable-tiny")


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
