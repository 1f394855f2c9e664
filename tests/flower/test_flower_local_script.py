"""infra/flower-local.sh refuses what SuperNode authentication must not run with, before it
starts or writes anything (only the slow test starts a SuperLink, which fails on fake
certificates; tests/flower/test_deployment.py runs the script's authenticated deployment)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "infra" / "flower-local.sh"
VENV = str(Path(sys.executable).parents[1])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(run: Path, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("CLMA_FLOWER_")}
    e.update(CLMA_FLOWER_DIR=str(run), CLMA_FLOWER_PORT=str(_port()),
             CLMA_FLOWER_NODE_PORT=str(_port()), CLMA_VENV=VENV, **env)
    return subprocess.run([str(SCRIPT), *args], env=e, capture_output=True, text=True,
                          timeout=timeout)


def _fake_tls(folder: Path) -> Path:
    folder.mkdir()
    for f in ("ca.crt", "server.crt", "server.key"):
        (folder / f).write_text("not checked before the refusals\n")
    return folder


@pytest.mark.parametrize("value", ["maybe", "on", "2"])
def test_auth_setting_must_be_true_or_false(tmp_path, value):
    r = _run(tmp_path / "run", "start", "1", CLMA_FLOWER_AUTH=value)
    assert r.returncode == 1
    assert f"CLMA_FLOWER_AUTH='{value}': use true or false" in r.stderr
    assert not (tmp_path / "run").exists()


def test_auth_without_tls_is_refused_and_nothing_is_made(tmp_path):
    r = _run(tmp_path / "run", "start", "2", CLMA_FLOWER_AUTH="true")
    assert r.returncode == 1
    assert "CLMA_FLOWER_AUTH=true needs TLS" in r.stderr and "CLMA_FLOWER_TLS" in r.stderr
    assert not (tmp_path / "run").exists()


def test_keys_are_refused_inside_the_checkout_unless_git_ignores_them(tmp_path):
    run = ROOT / "flower-run-not-ignored"  # not matched by .gitignore
    assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(run / "keys")]
                          ).returncode == 1
    r = _run(run, "start", "1", CLMA_FLOWER_TLS=str(_fake_tls(tmp_path / "tls")))
    assert r.returncode == 1
    assert "inside the checkout and not git-ignored" in r.stderr
    assert not run.exists()  # refused before the run folder was made


def test_a_private_key_others_may_read_is_refused_before_anything_starts(tmp_path):
    keys = tmp_path / "run" / "keys"
    keys.mkdir(parents=True)
    (keys / "supernode-0").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (keys / "supernode-0").chmod(0o644)
    (keys / "supernode-0.pub").write_text("ecdsa-sha2-nistp384 AAAA\n")
    r = _run(tmp_path / "run", "start", "1", CLMA_FLOWER_TLS=str(_fake_tls(tmp_path / "tls")))
    assert r.returncode == 1
    assert f"{keys / 'supernode-0'}: mode 644 lets group or others read the private key" in r.stderr
    assert "chmod 600" in r.stderr
    assert not list((tmp_path / "run").glob("*.pid"))  # no SuperLink, no SuperNode
    assert not (tmp_path / "run" / "superlink.log").exists()


@pytest.mark.slow  # starts a real flower-superlink (it fails on the fake certificates)
def test_with_tls_authentication_is_on_unless_turned_off(tmp_path):
    # TLS without CLMA_FLOWER_AUTH means authentication: the key check above runs (and
    # refuses); CLMA_FLOWER_AUTH=false skips the keys and goes on to start the SuperLink,
    # which here fails on the fake certificates -- after the point the keys would be made
    keys = tmp_path / "run" / "keys"
    keys.mkdir(parents=True)
    (keys / "supernode-0").write_text("x")
    (keys / "supernode-0").chmod(0o640)
    (keys / "supernode-0.pub").write_text("x")
    tls = str(_fake_tls(tmp_path / "tls"))
    on = _run(tmp_path / "run", "start", "1", CLMA_FLOWER_TLS=tls)
    assert on.returncode == 1 and "mode 640 lets group or others read" in on.stderr
    off = _run(tmp_path / "run", "start", "1", CLMA_FLOWER_TLS=tls, CLMA_FLOWER_AUTH="false",
               timeout=300)
    assert "mode 640" not in off.stderr
    assert off.returncode == 1 and "SuperLink exited during start-up" in off.stderr, off.stderr
    assert not list((tmp_path / "run").glob("*.pid"))


@pytest.mark.parametrize("value", ["mysite.data", "mysite.data:f:g", "my site:f", ":f",
                                   "mysite.data:", "a;rm -rf x:f"])
def test_a_data_source_that_is_not_module_function_is_refused(tmp_path, value):
    r = _run(tmp_path / "run", "start", "1", CLMA_FLOWER_DATA_SOURCE=value)
    assert r.returncode == 1
    assert f"CLMA_FLOWER_DATA_SOURCE='{value}': must be package.module:function" in r.stderr
    assert not (tmp_path / "run").exists()


def _superlink_args(run: Path) -> list[str]:
    pid = (run / "superlink.pid").read_text().strip()
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.mark.server
def test_the_superlink_keeps_its_state_in_memory_unless_a_file_is_named(tmp_path):
    # Under load flwr 1.42's SQLite state fails requests with "database is locked" after its
    # 5 s busy timeout, which ended a ten-node run on CI; the in-memory state has no such
    # lock. A named file is the operator's choice (state kept over a SuperLink restart).
    from tests.flower.test_deployment import _leftovers

    for name, env in (("memory", {}), ("file", {"CLMA_FLOWER_DATABASE": "FILE"})):
        run = tmp_path / name
        db = tmp_path / f"{name}.db"
        env = {k: str(db) if v == "FILE" else v for k, v in env.items()}
        try:
            up = _run(run, "start", "1", timeout=300, **env)
            assert up.returncode == 0, up.stdout + up.stderr
            args = _superlink_args(run)
            if name == "memory":
                assert "--database" not in args
                assert not list(tmp_path.rglob("*.db")), "no state file without one named"
            else:
                assert args[args.index("--database") + 1] == str(db)
                assert db.is_file() and db.stat().st_size > 0
        finally:
            down = _run(run, "stop", timeout=120)
            assert down.returncode == 0, down.stdout + down.stderr
        assert not _leftovers(str(run))
