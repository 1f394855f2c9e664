"""fed-clma 0.1.1 itself, for the compatibility tests: its README's code blocks (read from
the wheel's METADATA, so a snippet runs exactly as published) and its package, importable
under the alias ``fedclma_ref`` or, inside :func:`fedclma_as_clma`, as ``clma``.

The wheel's files are vendored unmodified in ``tests/fixtures/fed_clma_0_1_1`` (Apache-2.0,
its LICENSE beside them; ``pip download fed-clma==0.1.1 --no-deps``, wheel sha256
77fc75b004b65ec297bfae20e4ce13461aa5cd627bc5c4da090687bca3afa70c);
``test_fedclma_serverapp.py`` checks every file against the wheel's RECORD hashes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flwr.app import Context, Error, Message, RecordDict

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "fed_clma_0_1_1"
METADATA = ROOT / "fed_clma-0.1.1.dist-info" / "METADATA"
ALIAS = "fedclma_ref"


def readme() -> str:
    """fed-clma 0.1.1's README (the long description in its METADATA)."""
    text = METADATA.read_text(encoding="utf-8")
    return text.split("\n\n", 1)[1]


def python_blocks() -> list[str]:
    """Every ```python block of the README, in order."""
    return re.findall(r"```python\n(.*?)```", readme(), flags=re.S)


def snippet(marker: str) -> str:
    """The one README python block containing ``marker``."""
    found = [b for b in python_blocks() if marker in b]
    assert len(found) == 1, f"{marker!r} is in {len(found)} README blocks"
    return found[0]


def load() -> object:
    """fed-clma's package ``clma``, imported as :data:`ALIAS` (once)."""
    if ALIAS in sys.modules:
        return sys.modules[ALIAS]
    pkg = ROOT / "clma"
    spec = importlib.util.spec_from_file_location(ALIAS, pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[ALIAS] = mod
    spec.loader.exec_module(mod)
    return mod


@contextmanager
def fedclma_as_clma() -> Iterator[object]:
    """Inside: ``import clma`` (and ``clma.client`` ...) is fed-clma 0.1.1; this package's
    modules are put back on exit. For exec'ing a snippet as a fed-clma user runs it."""
    ref = load()
    ours = {k: v for k, v in sys.modules.items() if k == "clma" or k.startswith("clma.")}
    for k in ours:
        del sys.modules[k]
    sys.modules["clma"] = ref
    for k, v in list(sys.modules.items()):
        if k.startswith(ALIAS + "."):
            sys.modules["clma" + k[len(ALIAS):]] = v
    try:
        yield ref
    finally:
        for k in [k for k in sys.modules if k == "clma" or k.startswith("clma.")]:
            del sys.modules[k]
        sys.modules.update(ours)


def run(source: str, **names) -> dict:
    """Execute ``source`` (a README snippet, unchanged) in a namespace holding ``names``."""
    ns = dict(names)
    exec(compile(source, "<fed-clma README>", "exec"), ns)  # noqa: S102
    return ns


class AppGrid:
    """A ``Grid`` whose nodes are ClientApps in this process (node id -> app), replying as
    a SuperNode does: an exception raised by the ClientApp (e.g. Flower's "No query function
    registered") becomes an error reply with code 2 and the reason text Flower's
    ``run_clientapp`` writes. ``sent``: (message type, node) of every message."""

    def __init__(self, apps: dict[int, object]) -> None:
        self.apps = apps
        self.contexts = {n: Context(run_id=7, node_id=n, node_config={}, state=RecordDict(),
                                    run_config={}) for n in apps}
        self.sent: list[tuple[str, int]] = []

    def get_node_ids(self):
        return sorted(self.apps)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            node = m.metadata.dst_node_id
            self.sent.append((m.metadata.message_type, node))
            try:
                reply = self.apps[node](m, self.contexts[node])
            except Exception as ex:  # flwr/supernode/runtime/run_clientapp.py
                reply = Message(Error(code=2, reason=str(type(ex)) + ":<'" + str(ex) + "'>"),
                                reply_to=m)
            reply.metadata.__dict__["_src_node_id"] = node
            out.append(reply)
        return out
