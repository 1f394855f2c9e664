"""Flower test helpers: messages need a run id outside a real ServerApp, and a loopback
grid hands each message to a ClientApp in this process (no Ray, no SuperLink)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from flwr.app import Context, Error, Message, RecordDict

#: The tiny federation (6 clients, seeded noise) every Flower test compares with the engine.
TINY = Path(__file__).resolve().parents[1] / "scale_out" / "tiny_dask.toml"
_ALLOW_SEEDED = "\n[testing]\nallow_seeded_noise_not_private = true\n"


def allow_seeded(cfg):
    """``cfg`` with ``testing.allow_seeded_noise_not_private``: the Flower path refuses
    seeded noise otherwise, and these tests compare its values with the engine's."""
    return cfg.model_copy(update={"testing": cfg.testing.model_copy(
        update={"allow_seeded_noise_not_private": True})})


def tiny_config():
    """The tiny federation's config, seeded noise allowed on the Flower path (tests)."""
    from clma.config import load_config

    return allow_seeded(load_config(TINY))


def tiny_toml(folder: Path) -> Path:
    """A copy of the tiny federation's TOML in ``folder`` that allows seeded noise on the
    Flower path (for apps that load their config from a file)."""
    text = TINY.read_text(encoding="utf-8")
    assert "[testing]" not in text
    out = Path(folder) / TINY.name
    out.write_text(text + _ALLOW_SEEDED, encoding="utf-8")
    return out


@pytest.fixture
def run_id():
    """Messages can only be built with a run id (a ServerApp sets it)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield 7
    TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


class LoopbackGrid:
    """A ``Grid`` whose nodes are ClientApps in this process.

    ``nodes``: node id -> node config (``partition-id`` ...); ``tamper(call_type, node,
    reply) -> reply | None`` may rewrite or drop a reply (None: no reply); ``down``: nodes
    that answer nothing; ``superlink_down``: nodes for which the SuperLink itself answers
    "node unavailable" (an error reply from node 0).
    """

    def __init__(self, app, nodes: dict[int, dict], run_config: dict | None = None,
                 tamper: Callable | None = None) -> None:
        self.app = app
        self.contexts = {n: Context(run_id=7, node_id=n, node_config=dict(cfg),
                                    state=RecordDict(), run_config=dict(run_config or {}))
                         for n, cfg in nodes.items()}
        self.tamper = tamper
        self.down: set[int] = set()
        self.superlink_down: set[int] = set()
        self.sent: list[tuple[str, int]] = []
        self.calls = 0

    def get_node_ids(self):
        return sorted(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        self.calls += 1
        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            node, kind = m.metadata.dst_node_id, m.metadata.message_type
            self.sent.append((kind, node))
            if node in self.down:
                continue
            if node in self.superlink_down:
                err = Message(Error(code=5, reason="Error: Node Unavailable"), reply_to=m)
                err.metadata.__dict__["_src_node_id"] = 0
                out.append(err)
                continue
            reply = self.app(m, self.contexts[node])
            if self.tamper is not None:
                reply = self.tamper(kind, node, reply)
            if reply is not None:
                out.append(reply)
        return out
