"""The ``flower`` transport: the ``Clients`` seam over Flower's message API (a ServerApp's
``Grid``), so the round engine reaches real clients on Flower SuperNodes.

:class:`FlowerTransport` implements :class:`clma.engine.clients.Clients`:

* ``roster()`` -- waits for ``node_count`` SuperNodes (at most ``connect_timeout``), asks
  each once for its ``partition-id`` (one ``query.clma_roster`` round-trip; the partition id
  is the client id) and places it in its region of the public partition
  (``clma.regions.load_partition(...).assign(clients, seed)``). A node that does not answer,
  answers badly, claims a partition id another node claims too, or (with ``model_layout``)
  reports a model whose parameter count or layout differs from the server's is left out,
  with its reason in :attr:`roster_failures`, the run's Flower log and the journal's log. Clients the
  journal shows were asked in a round not committed yet stay in the roster even when not
  connected now (a resumed round is the same round; they are dropouts of what they miss).
  A node whose ClientApp has no query handler (a fed-clma ClientApp) gets a client id no
  node claimed and fed-clma's message format when the strategy set :attr:`layout`
  (:mod:`clma.flower.fedclma`); otherwise it is left out.
* every other call is ONE ``grid.send_and_receive`` for all the clients it asks, with
  ``timeout`` seconds for the replies; the secure-aggregation steps carry all the sessions
  of a client in one message (:mod:`clma.flower.codec`), so an evaluation round costs four
  round-trips whatever the number of groups.
* every failure -- no reply by the timeout, an error reply (the ClientApp's, or the
  SuperLink's "node unavailable"), a reply that does not decode (wrong schema, types,
  ranges, lengths) -- becomes a :attr:`Replies.failed` entry with its reason; the engine's
  own checks follow (:func:`clma.engine.clients.check_update`, the secure-aggregation
  server's). A call never raises for a client's behaviour.
* every completed exchange is recorded in the :class:`clma.flower.journal.ExchangeJournal`
  before its replies are used; a client asked the same message again (a retry, a resumed
  round) gets its recorded outcome, so no client exchange of a committed step runs twice.

Flower's objects stay behind this edge: the engine sees only the seam's dataclasses. The
grid is not thread-safe: calls (e.g. concurrent training chunks) take turns.

Test-only fault injection: ``CLMA_FLOWER_FAILPOINT=<action>:<round>:<call>[,...]`` acts
right after that exchange was recorded in the journal (and only when it was actually sent):
``kill`` SIGKILLs this process (the orchestrating ServerApp) and its children; ``pause`` creates
``<journal>/failpoint-<round>-<call>.paused`` and waits until that file is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.app import Message

from clma.config import FederationConfig
from clma.engine.clients import (
    ChoiceRequest,
    ClientInfo,
    Replies,
    ReportRequest,
    Roster,
    ShareKeysRequest,
    TrainRequest,
)
from clma.flower import codec, fedclma
from clma.flower.journal import ExchangeJournal, JournalEntry
from clma.rounds import ClientUpdate

__all__ = ["FAILPOINT_ENV", "FlowerTransport", "check_noise_source"]

FAILPOINT_ENV = "CLMA_FLOWER_FAILPOINT"
_log = logging.getLogger("clma.flower.transport")


def check_noise_source(config: FederationConfig) -> str:
    """The Flower transport's noise rule (the config's, :meth:`FederationConfig.
    seeded_noise_refusal` with real clients); returns the label recorded with every
    release it touches.

    Real clients mean real people's data: seeded noise is reproducible and NOT private, so
    it is refused unless ``testing.allow_seeded_noise_not_private`` (the equality tests
    against the in-process simulation); then every release it touches is labelled
    ``seeded-simulation``.

    Raises:
        ConfigError: seeded noise without ``testing.allow_seeded_noise_not_private``.
    """
    from clma.config import ConfigError

    refusal = config.seeded_noise_refusal(real_server=False, real_clients=True)
    if refusal is not None:
        raise ConfigError(refusal)
    return "seeded-simulation" if config.seeded_noise else "opendp"


def _flower_log(text: str) -> None:
    """One line in the Flower run's log (``flwr log``): the operator's view of the steps."""
    from flwr.supercore import log

    log(logging.INFO, "%s", text)


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc), deepest first."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.extend(kids)
        todo.extend(kids)
    return out[::-1]


def _reason(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class FlowerTransport:
    """The ``flower`` transport (module docstring).

    Args:
        grid: the ServerApp's ``flwr.serverapp.Grid``.
        config: the federation config (``clients``, ``seed``, region partition,
            ``federation.flower`` timeouts).
        state_dir: the federation's state folder (the journal lives in it); None: memory.
        partition: the region partition (default: ``config.data.region_partition``).
        client_id_of: node id -> client id instead of asking the nodes' partition ids.
        timeout / connect_timeout / node_count: override ``federation.flower``'s.
        n_params: the model length (train replies of another length are malformed).
        model_layout: the server model's ``(n_params, digest)``
            (:func:`clma.models.checks.model_layout`): the roster refuses a node that
            reports another layout, or none (None: not checked).
        journal: an explicit journal (default: one in ``state_dir``).
    """

    transport = "flower"

    def __init__(self, grid: Any, config: FederationConfig, *,
                 state_dir: str | os.PathLike | None = None, partition: Any = None,
                 client_id_of: Callable[[int], int] | None = None,
                 timeout: float | None = None, connect_timeout: float | None = None,
                 node_count: int | None = None, n_params: int | None = None,
                 model_layout: tuple[int, str] | None = None,
                 journal: ExchangeJournal | None = None) -> None:
        fl = config.flower
        self.grid = grid
        self.config = config
        self.timeout = float(timeout if timeout is not None else fl.timeout_seconds)
        self.connect_timeout = float(connect_timeout if connect_timeout is not None
                                     else fl.connect_timeout_seconds)
        self.node_count = int(node_count or fl.node_count or config.clients)
        self.client_id_of = client_id_of
        self.n_params = n_params
        self.model_layout = model_layout
        #: the strategy's ArrayLayout: fed-clma-format train replies (named arrays, no
        #: header; clma.flower.fedclma) are accepted when it is set
        self.layout: Any = None
        #: client ids of the nodes that speak fed-clma's format (clma.flower.fedclma), and
        #: the train config their messages carry (fed-clma's ``start(train_config=...)``)
        self.fedclma_clients: set[int] = set()
        self.train_config: Mapping[str, Any] = {}
        self._partition = partition
        self.run_id = self._run_id(grid)
        self.journal = journal if journal is not None else ExchangeJournal(state_dir, self.run_id)
        self._lock = threading.Lock()
        self._roster: Roster | None = None
        self.node_of: dict[int, int] = {}
        self.roster_failures: dict[int, str] = {}
        self.absent: list[int] = []
        self.closed = False

    @staticmethod
    def _run_id(grid: Any) -> int | None:
        try:
            return int(grid.run.run_id)
        except Exception:  # a grid without a run (tests) has none
            return None

    # ---------------------------------------------------------------- exchange
    def _send(self, messages: dict[int, Message]) -> tuple[dict[int, Message], dict[int, str]]:
        """One ``send_and_receive``: client id -> reply message, client id -> failure."""
        if not messages:
            return {}, {}
        with self._lock:
            try:
                got = list(self.grid.send_and_receive(list(messages.values()),
                                                      timeout=self.timeout))
            except Exception as exc:  # the link itself failed: every asked client
                return {}, {c: f"transport error: {type(exc).__name__}" for c in messages}
        return self._match(messages, got)

    def _match(self, messages: dict[int, Message], got: Sequence[Message]
               ) -> tuple[dict[int, Message], dict[int, str]]:
        """Pair replies with the messages sent (by message id; the SuperLink's own error
        replies come from node 0): client id -> reply, client id -> failure."""
        replies: dict[int, Message] = {}
        failed: dict[int, str] = {}
        client_of_node = {m.metadata.dst_node_id: c for c, m in messages.items()}
        client_of_msg = {m.metadata.message_id: c for c, m in messages.items()
                         if m.metadata.message_id}
        for r in got:
            c = client_of_msg.get(r.metadata.reply_to_message_id)
            if c is None:
                c = client_of_node.get(r.metadata.src_node_id)
            if c is None or c in replies or c in failed:
                continue  # not a reply to this exchange, or a duplicate
            if r.has_error():
                failed[c] = _reason(f"error reply (code {r.error.code}): {r.error.reason or ''}")
            else:
                replies[c] = r
        for c in messages:
            if c not in replies and c not in failed:
                failed[c] = f"no reply within {self.timeout:g} s"
        return replies, failed

    def _message(self, content: Any, client_id: int, call: str, round_number: int) -> Message:
        return Message(content=content, dst_node_id=self.node_of[client_id],
                       message_type=codec.MESSAGE_TYPES[call], group_id=str(round_number))

    def _exchange(self, call: str, round_number: int, contents: dict[int, Any],
                  decode: Callable[[int, Any], Any], store: Callable[[Any], Any],
                  load: Callable[[int, Any], Any], unknown: Sequence[int] = ()) -> Replies:
        """Run one exchange of ``call``: clients whose exact message a recorded exchange
        already carried get their recorded outcome; the others are asked (one
        ``send_and_receive``) and the exchange is recorded before its replies are used.
        ``decode(client, content)`` checks a reply; ``store`` / ``load`` convert a decoded
        reply to and from its journal form."""
        self.journal.prune()
        t0 = time.perf_counter()
        digests = {c: codec.content_digest(contents[c]) for c in sorted(contents)}
        h = hashlib.sha256(f"{call}|{round_number}".encode())
        for c, d in digests.items():
            h.update(f"|{c}:{d}".encode())
        key = h.hexdigest()[:32]
        out: Replies = Replies({}, {c: "not a connected node of this federation"
                                    for c in unknown})
        for c, (kind, v) in self.journal.covered(round_number, call, digests).items():
            if kind == "ok":
                out.ok[c] = load(c, v)
            else:
                out.failed[c] = v
        replayed = len(out.ok) + len(out.failed) - len(unknown)
        todo = {c: contents[c] for c in contents if c not in out.ok and c not in out.failed}
        if not todo:
            _flower_log(f"clma: round {round_number} {call}: answered from the journal "
                        "(a committed exchange is never sent twice)")
            self.journal.log(round=round_number, call=call, key=key, status="replayed",
                             asked=len(contents) + len(unknown), ok=len(out.ok),
                             failed=len(out.failed), seconds=time.perf_counter() - t0)
            return out
        messages = {c: self._message(todo[c], c, call, round_number) for c in todo}
        replies, failed = self._send(messages)
        new: Replies = Replies({}, dict(failed))
        for c, r in replies.items():
            try:
                new.ok[c] = decode(c, r.content)
            except codec.CodecError as exc:
                new.failed[c] = _reason(f"malformed reply: {exc}")
            except Exception as exc:  # a reply our decoder could not even walk
                new.failed[c] = f"malformed reply: {type(exc).__name__}"
        self.journal.record(round_number, call, key, JournalEntry(
            {c: store(v) for c, v in new.ok.items()}, dict(new.failed),
            {"flower_run_id": self.run_id, "round": round_number, "call": call,
             "digests": {str(c): digests[c] for c in todo}}))
        out.ok.update(new.ok)
        out.failed.update(new.failed)
        seconds = time.perf_counter() - t0
        self.journal.log(round=round_number, call=call, key=key, status="sent",
                         asked=len(contents) + len(unknown), ok=len(out.ok),
                         failed=len(out.failed), sent=len(todo), replayed=replayed,
                         seconds=seconds)
        _flower_log(f"clma: round {round_number} {call}: {len(todo)} asked, "
                    f"{len(new.ok)} answered, {len(new.failed)} failed ({seconds:.1f} s)"
                    + (f"; {replayed} from the journal" if replayed else ""))
        self._failpoint(round_number, call)
        return out

    def _failpoint(self, round_number: int, call: str) -> None:
        action = None
        for spec in os.environ.get(FAILPOINT_ENV, "").split(","):
            try:
                a, rnd, name = spec.strip().split(":")
                if int(rnd) == round_number and name == call:
                    action = a
            except ValueError:
                continue
        if action == "kill":
            _log.warning("failpoint: killing the orchestrating process after %s of round %s",
                         call, round_number)
            for child in _children(os.getpid()):  # e.g. its temporary Prefect API server
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "pause":
            base = self.journal.root or Path(tempfile.gettempdir())
            marker = Path(base) / f"failpoint-{round_number}-{call}.paused"
            marker.write_text(str(os.getpid()))
            deadline = time.monotonic() + 900
            while marker.exists() and time.monotonic() < deadline:
                time.sleep(0.2)

    def _split(self, ids: Sequence[int]) -> tuple[list[int], list[int]]:
        self.roster()
        known = [c for c in sorted(ids) if c in self.node_of]
        return known, [c for c in sorted(ids) if c not in self.node_of]

    # ---------------------------------------------------------------- seam
    def roster(self) -> Roster:
        """Who exists and where (asked once; module docstring)."""
        if self._roster is not None:
            return self._roster
        from clma.regions import load_partition

        deadline = time.monotonic() + self.connect_timeout
        nodes = sorted(int(n) for n in self.grid.get_node_ids())
        while len(nodes) < self.node_count and time.monotonic() < deadline:
            time.sleep(1.0)
            nodes = sorted(int(n) for n in self.grid.get_node_ids())
        if len(nodes) < self.node_count:
            _log.warning("roster: %d of %d SuperNodes connected after %.0f s; starting with "
                         "those", len(nodes), self.node_count, self.connect_timeout)
        claims: dict[int, list[int]] = {}
        foreign: list[int] = []  # nodes whose ClientApp has no query handler (fed-clma's)
        if self.client_id_of is not None:
            for n in nodes:
                try:
                    c = codec._int(self.client_id_of(n), "client_id_of(node)", 0,
                                   self.config.clients - 1)
                except (codec.CodecError, KeyError) as exc:
                    self.roster_failures[n] = f"no client id: {exc}"
                    continue
                claims.setdefault(c, []).append(n)
        else:
            msgs = {i: Message(content=codec.encode_roster_request(), dst_node_id=n,
                               message_type=codec.MESSAGE_TYPES["roster"], group_id="roster")
                    for i, n in enumerate(nodes)}
            replies, failed = self._send(msgs)
            for i, why in failed.items():
                if fedclma.is_unregistered_query(why):
                    foreign.append(nodes[i])
                else:
                    self.roster_failures[nodes[i]] = why
            for i, r in replies.items():
                try:
                    c = codec.decode_roster_reply(r.content, self.config.clients)
                    layout = codec.decode_roster_layout(r.content)
                except codec.CodecError as exc:
                    self.roster_failures[nodes[i]] = _reason(f"malformed reply: {exc}")
                    continue
                why = self._layout_refusal(layout)
                if why is not None:
                    self.roster_failures[nodes[i]] = why
                    continue
                claims.setdefault(c, []).append(nodes[i])
        for c, ns in claims.items():
            if len(ns) > 1:
                for n in ns:
                    self.roster_failures[n] = "another node claims the same partition id"
            else:
                self.node_of[c] = ns[0]
        self._admit_fedclma(foreign, set(claims))
        partition = self._partition
        if partition is None:
            partition = load_partition(self.config.data.region_partition)
        regions = partition.assign(self.config.clients, self.config.seed)
        # a round in progress (resumed after a crash) keeps the clients it asked: one gone
        # since is a dropout of the steps it misses, not a different round
        members = set(self.node_of) | {c for c in self.journal.clients_in_progress()
                                       if 0 <= c < self.config.clients}
        self.absent = sorted(members - set(self.node_of))
        self._roster = Roster(tuple(ClientInfo(c, regions[c]) for c in sorted(members)))
        self.journal.log(round=0, call="roster", status="sent", asked=len(nodes),
                         ok=len(self.node_of), failed=len(self.roster_failures),
                         clients=sorted(self.node_of),
                         refused={str(n): why for n, why in sorted(self.roster_failures.items())})
        for n, why in sorted(self.roster_failures.items()):
            _flower_log(f"clma: roster: SuperNode {n} left out: {why}")
        _flower_log(f"clma: roster: {len(self.node_of)} of {len(nodes)} SuperNodes are "
                    f"clients {sorted(self.node_of)}"
                    + (f"; clients {self.absent} of the round in progress are not connected"
                       if self.absent else ""))
        return self._roster

    def _layout_refusal(self, layout: tuple[int, str] | None) -> str | None:
        """Why a node reporting ``layout`` cannot join (None: it can)."""
        if self.model_layout is None:
            return None
        if layout is None:
            return ("model layout: the node reports none (its clma is older than the "
                    "server's, or its ClientApp is not CLMA's)")
        (n_dev, d_dev), (n_srv, d_srv) = layout, self.model_layout
        if n_dev != n_srv:
            return (f"model layout: the node's model has {n_dev:,} parameters, the "
                    f"server's {n_srv:,} (install the same model.factory on both)")
        if d_dev != d_srv:
            return ("model layout: the node's tensors differ from the server's in names, "
                    f"shapes or dtypes ({n_dev:,} parameters on both; install the same "
                    "model.factory on both)")
        return None

    def _admit_fedclma(self, nodes: Sequence[int], claimed: set[int]) -> None:
        """Give each fed-clma-format node (no query handler) a client id nobody claimed,
        lowest first, in node-id order; without the strategy's layout they are left out."""
        free = (c for c in range(self.config.clients) if c not in claimed)
        for n in sorted(nodes):
            if self.layout is None:
                self.roster_failures[n] = ("its ClientApp answers no partition-id query (a "
                                           "fed-clma ClientApp): only clma.CLMA serves those")
                continue
            c = next(free, None)
            if c is None:
                self.roster_failures[n] = "no client id left in [0, clients) for this node"
                continue
            self.node_of[c] = n
            self.fedclma_clients.add(c)

    def _train_content(self, request: TrainRequest, c: int) -> Any:
        if c in self.fedclma_clients:
            return fedclma.encode_train_request(request, c, self.layout, self.train_config)
        return codec.encode_train_request(request, c)

    def _train_decoder(self, request: TrainRequest) -> Callable[[int, Any], ClientUpdate]:
        def decode(c: int, content: Any) -> ClientUpdate:
            if self.layout is not None and fedclma.is_fedclma_reply(content):
                return fedclma.decode_train_reply(content, self.layout, client_id=c,
                                                  cohort_id=int(request.assignments[c]))
            return codec.decode_train_reply(content, round_number=request.round, client_id=c,
                                            cohort_id=int(request.assignments[c]),
                                            n_params=self.n_params)

        return decode

    def train(self, request: TrainRequest) -> Replies[ClientUpdate]:
        known, unknown = self._split(list(request.assignments))
        contents = {c: self._train_content(request, c) for c in known}
        return self._exchange(
            "train", request.round, contents, self._train_decoder(request),
            store=lambda u: (u.params, u.n_samples, u.drift_flag, u.cohort_id),
            load=lambda c, v: ClientUpdate(c, v[3], v[0], v[1], v[2]), unknown=unknown)

    # ------------------------------------------------------------ strategy side
    def messages(self, call: str, request: TrainRequest) -> list[Message]:
        """The messages of a training call without sending them (a Flower ``Strategy``
        returns them from ``configure_train``; Flower's loop sends them)."""
        if call != "train":
            raise ValueError("messages: only 'train' is sent by Flower's strategy loop")
        known, _ = self._split(list(request.assignments))
        return [self._message(self._train_content(request, c), c, call, request.round)
                for c in known]

    def collect(self, call: str, request: TrainRequest, sent: Sequence[Message],
                got: Sequence[Message]) -> tuple[Replies[ClientUpdate], dict[int, Message]]:
        """The replies Flower's loop received for :meth:`messages`: checked seam replies
        (every failure a failed entry) and client id -> accepted reply message."""
        if call != "train":
            raise ValueError("collect: only 'train' is sent by Flower's strategy loop")
        by_client = {self._client_of_node(m.metadata.dst_node_id): m for m in sent}
        replies, failed = self._match(by_client, list(got))
        out: Replies[ClientUpdate] = Replies({}, dict(failed))
        for c in request.assignments:
            if c not in by_client:
                out.failed[c] = "not a connected node of this federation"
        decode = self._train_decoder(request)
        accepted: dict[int, Message] = {}
        for c, r in replies.items():
            try:
                out.ok[c] = decode(c, r.content)
                accepted[c] = r
            except codec.CodecError as exc:
                out.failed[c] = _reason(f"malformed reply: {exc}")
            except Exception as exc:
                out.failed[c] = f"malformed reply: {type(exc).__name__}"
        return out, accepted

    def _client_of_node(self, node: int) -> int:
        for c, n in self.node_of.items():
            if n == node:
                return c
        raise KeyError(node)

    def _step(self, call: str, round_number: int, contents: dict[int, Any],
              sessions: Mapping[int, Sequence[str]], unknown: Sequence[int]) -> Replies:
        def decode(c: int, content: Any) -> dict[str, Any]:
            return codec.decode_step_reply(call, content, round_number=round_number,
                                           client_id=c, sessions=sessions[c])

        return self._exchange(call, round_number, contents, decode,
                              store=lambda items: codec.step_payload(call, items),
                              load=lambda c, b: codec.step_items_from_payload(call, b),
                              unknown=unknown)

    def secagg_advertise(self, request: ReportRequest) -> Replies:
        members = sorted({c for s in request.sessions.values() for c in s.members})
        known, unknown = self._split(members)
        contents = {c: codec.encode_report_request(request, c) for c in known}
        sessions = {c: list(request.sessions_of(c)) for c in known}
        return self._step("secagg_advertise", request.round, contents, sessions, unknown)

    def _simple(self, call: str, round_number: int,
                requests: Mapping[int, Mapping[str, Any]]) -> Replies:
        known, unknown = self._split(list(requests))
        contents = {c: codec.encode_step_request(call, round_number, c, requests[c])
                    for c in known}
        return self._step(call, round_number, contents, {c: list(requests[c]) for c in known},
                          unknown)

    def secagg_share_keys(self, round: int,  # noqa: A002
                          requests: Mapping[int, Mapping[str, ShareKeysRequest]]) -> Replies:
        return self._simple("secagg_share_keys", round, requests)

    def secagg_masked_input(self, round: int,  # noqa: A002
                            inboxes: Mapping[int, Mapping[str, Sequence[Any]]]) -> Replies:
        return self._simple("secagg_masked_input", round, inboxes)

    def secagg_unmask(self, round: int,  # noqa: A002
                      requests: Mapping[int, Mapping[str, Any]]) -> Replies:
        return self._simple("secagg_unmask", round, requests)

    def choose(self, request: ChoiceRequest) -> Replies[int]:
        known, unknown = self._split(list(request.candidates))
        old = [c for c in known if c in self.fedclma_clients]  # fed-clma's app cannot choose
        contents = {c: codec.encode_choice_request(request, c) for c in known if c not in old}

        def decode(c: int, content: Any) -> int:
            return codec.decode_choice_reply(content, round_number=request.round,
                                             client_id=c, candidates=request.candidates[c])

        out: Replies[int] = (
            self._exchange("choose", request.round, contents, decode,
                           store=lambda k: str(int(k)).encode("ascii"),
                           load=lambda c, b: int(b.decode("ascii")), unknown=unknown)
            if contents else Replies({}, {c: "not a connected node of this federation"
                                          for c in unknown}))
        out.failed.update({c: "fed-clma's ClientApp has no choose call" for c in old})
        return out

    def close(self) -> None:
        """Nothing to release: the grid belongs to the ServerApp."""
        self.closed = True
