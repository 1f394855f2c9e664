"""``clma keygen`` and the checks ``clma approve`` makes before it talks to Prefect."""

from __future__ import annotations

import os
import stat
import subprocess
import tomllib

import pytest

# flows.approval imports prefect at collection, not under capsys: prefect's log handlers
# keep the stream they bind to, and capsys closes its own after each test.
import flows.approval  # noqa: F401
from clma.budget.approval_token import load_private_key
from flows.cli import main


def test_keygen_writes_a_0600_key_and_prints_only_the_policy_entry(tmp_path, capsys):
    out = tmp_path / "keys" / "po.pem"
    assert main(["keygen", "--approver", "privacy-officer", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert stat.S_IMODE(out.parent.stat().st_mode) == 0o700
    pem = out.read_text()
    assert pem.startswith("-----BEGIN PRIVATE KEY-----")
    body = "".join(pem.splitlines()[1:-1])
    assert body not in captured.out and body not in captured.err  # never printed
    (entry,) = tomllib.loads(captured.out)["borrowing"]["approver_keys"]
    _, key_id = load_private_key(out)
    assert entry["name"] == "privacy-officer" and entry["key_id"] == key_id
    assert "mode 0600" in captured.err
    # never overwritten
    assert main(["keygen", "--approver", "privacy-officer", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert out.read_text() == pem


def test_keygen_prints_the_private_key_only_when_asked(tmp_path, capsys):
    out = tmp_path / "d.pem"
    assert main(["keygen", "--approver", "dpo-deputy", "--out", str(out),
                 "--print-private-key"]) == 0
    assert out.read_text() in capsys.readouterr().out


def test_keygen_default_path_and_refusals(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CLMA_KEY_DIR", str(tmp_path / "k"))
    assert main(["keygen", "--approver", "privacy officer/2"]) == 0
    assert (tmp_path / "k" / "privacy-officer-2.ed25519.pem").exists()
    assert main(["keygen", "--approver", " padded "]) == 2
    assert "--approver: a non-empty name" in capsys.readouterr().err
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    assert main(["keygen", "--approver", "x", "--out", str(repo / "x.pem")]) == 2
    assert "inside the git work tree" in capsys.readouterr().err
    assert not (repo / "x.pem").exists()
    (repo / ".gitignore").write_text("secrets/\n")
    assert main(["keygen", "--approver", "x", "--out", str(repo / "secrets" / "x.pem")]) == 0


def _key(tmp_path, mode: int):
    out = tmp_path / f"k{mode:o}.pem"
    assert main(["keygen", "--approver", "privacy-officer", "--out", str(out)]) == 0
    os.chmod(out, mode)
    return out


@pytest.mark.parametrize(("args", "message"), [
    (["not-a-uuid"], "RUN_ID: not a flow run id"),
    (["0b7f3c1e-2d4a-4c55-9e61-7a8b9c0d1e2f", "--wait", "-1"], "--wait: seconds in [0, 3600]"),
])
def test_approve_rejects_bad_arguments_before_prefect(tmp_path, capsys, args, message):
    key = _key(tmp_path, 0o600)
    capsys.readouterr()
    rc = main(["approve", *args, "--approver", "privacy-officer", "--key", str(key),
               "--reason", "r"])
    assert rc == 2 and message in capsys.readouterr().err


def test_approve_refuses_a_key_others_can_read(tmp_path, capsys):
    key = _key(tmp_path, 0o640)
    capsys.readouterr()
    rc = main(["approve", "0b7f3c1e-2d4a-4c55-9e61-7a8b9c0d1e2f", "--approver",
               "privacy-officer", "--key", str(key), "--reason", "r"])
    err = capsys.readouterr().err
    assert rc == 2 and "permissions 0640 are too open" in err and "chmod 600" in err


def test_approve_needs_key_and_reason(capsys):
    for missing in (["--reason", "r"], ["--key", "k.pem"]):
        with pytest.raises(SystemExit) as exc:
            main(["approve", "0b7f3c1e-2d4a-4c55-9e61-7a8b9c0d1e2f", "--approver", "p", *missing])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--key" in err and "--reason" in err
