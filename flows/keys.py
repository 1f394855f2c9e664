"""``clma keygen``: an approver's Ed25519 key pair, the private key kept out of sight.

The private key goes to a file created with mode 0600 (never overwritten, its folder
created 0700), outside the repository: a path inside a git work tree that git does not
ignore is refused. The policy entry (name, key id, public key) goes to stdout; the private
key is printed only with ``--print-private-key``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["cli_keygen", "default_key_path", "write_private_key"]


class KeygenError(ValueError):
    """A keygen argument broke a rule; the message names it."""


def default_key_path(approver: str) -> Path:
    """``$CLMA_KEY_DIR/<approver>.ed25519.pem`` (default folder ``~/.config/clma/keys``)."""
    folder = os.environ.get("CLMA_KEY_DIR") or str(Path.home() / ".config" / "clma" / "keys")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", approver).strip("-.") or "approver"
    return Path(folder) / f"{safe}.ed25519.pem"


def _git_root(path: Path) -> Path | None:
    for parent in [path, *path.parents]:
        if (parent / ".git").exists():
            return parent
    return None


def _check_outside_repository(path: Path) -> None:
    root = _git_root(path.parent.resolve())
    if root is None:
        return
    git = shutil.which("git")
    if git is not None:
        ignored = subprocess.run([git, "-C", str(root), "check-ignore", "-q", str(path.resolve())],
                                 capture_output=True).returncode == 0
        if ignored:
            return
    raise KeygenError(f"--out {str(path)!r}: inside the git work tree {root} and not "
                      "git-ignored; keep private keys outside the repository")


def write_private_key(path: Path, pem: bytes) -> None:
    """Create ``path`` with mode 0600 and write ``pem``; never overwrites a file."""
    if path.exists():
        raise KeygenError(f"--out {str(path)!r}: already exists (never overwritten)")
    _check_outside_repository(path)
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeygenError(f"--out {str(path)!r}: already exists (never overwritten)") from None
    except OSError as exc:
        raise KeygenError(f"--out {str(path)!r}: cannot be created ({exc.strerror})") from None
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(path, 0o600)  # whatever the umask


def cli_keygen(args: argparse.Namespace) -> int:
    from clma.budget.approval_token import generate_key_pair, policy_entry

    approver = args.approver
    try:
        if not approver or approver != approver.strip() or len(approver) > 128:
            raise KeygenError("--approver: a non-empty name without surrounding spaces, at most "
                              "128 characters")
        out = args.out if args.out is not None else default_key_path(approver)
        pem, entry = generate_key_pair(approver)
        write_private_key(out, pem)
    except KeygenError as exc:
        print(f"clma keygen: {exc}", file=sys.stderr)
        return 2
    print(f"clma keygen: private key written to {out} (mode 0600); add this entry to the "
          "[borrowing] section of the policy file:", file=sys.stderr)
    print(policy_entry(entry), end="")
    if args.print_private_key:
        print(pem.decode("ascii"), end="")
    return 0
