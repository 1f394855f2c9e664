"""Private evaluation on Flower: a strategy wrapper and its ClientApp handlers.

:class:`PrivateEvaluation` wraps any message-API strategy (``CLMA``, ``FedAvg``...):
training is the wrapped strategy's; its evaluate step becomes

1. ``evaluate.private_advertise_keys`` (the wrapped strategy's evaluate messages: each
   node gets its model): on the device, ``metrics_fn`` computes the metrics, each is
   clipped to its :class:`clma.release.MetricSpec` bounds and quantised
   (:class:`clma.privacy.secagg.FixedPointQuantiser`); the node replies with its two
   X25519 public keys;
2. ``evaluate.private_share_keys``: the server sends each node its neighbours' public
   keys; the node replies with its AES-GCM-encrypted Shamir shares;
3. ``evaluate.private_masked_input``: the server routes the shares; the node replies with
   its masked vector (uniform mod 2^k);
4. ``evaluate.private_unmasking``: the server names survivors and dropped nodes; each
   survivor replies with self-mask shares of survivors / key shares of dropped nodes;

one Flower round-trip through the grid per protocol step of the project's own secure
aggregation (:mod:`clma.privacy.secagg`: Bonawitz et al. CCS 2017, SecAgg+ graph of Bell
et al. CCS 2020); the protocol objects (``SecAggServer`` / ``SecAggClient``) are the
library's, only their messages are carried in Flower records. The server learns the exact
integer sum over the survivors and nothing about one node's metrics. Then, per metric,
:func:`clma.release.aggregate_sum` adds Laplace noise ONCE to the de-quantised sum
(sensitivity ``clip_high - clip_low``, one ``epsilon`` per metric: a round spends
``len(metrics) * epsilon``), and :func:`clma.release.build_federated_metric_envelope` wraps
the published value (clamped to the clip range), the participant band (never the count)
and the error bar from the band's lower edge. Below ``min_cohort`` survivors, or when the
protocol aborts (fewer than t survivors), nothing is released for that round.

Node-side secrets between steps live in the node's ``context.state`` (the device); they
never appear in a reply. Aggregation results: :attr:`PrivateEvaluation.releases`
(server-side ``AggregatedMetric`` with exact counts) and
:attr:`PrivateEvaluation.envelopes` (what may be published), per round.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from clma.privacy.secagg import (
    AdvertiseKeys,
    EncryptedShare,
    FixedPointQuantiser,
    MaskedInput,
    SecAggAbort,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    ShareKeys,
    UnmaskingRequest,
    UnmaskingResponse,
)
from clma.release import (
    AggregatedMetric,
    BelowCohortFloor,
    MetricSpec,
    aggregate_sum,
    build_federated_metric_envelope,
)

__all__ = ["PrivateEvaluation", "register_private_evaluation", "STEPS"]

STEPS = ("private_advertise_keys", "private_share_keys", "private_masked_input",
         "private_unmasking")
_CFG = "clma-private"
_STATE = "clma-secagg-state"


def _threshold(fraction: float, holders: int) -> int:
    t = max(2, math.ceil(fraction * holders))
    if 2 * t <= holders:
        t = holders // 2 + 1
    return min(t, holders)


class PrivateEvaluation(Strategy):
    """Wrap ``strategy`` so its evaluation is secure-aggregated and DP-released.

    Args:
        strategy: the wrapped message-API strategy (training and node sampling are its).
        metrics: the metric specs, in vector order; ``metrics_fn`` on the nodes returns a
            value for each name.
        epsilon: epsilon of each metric's Laplace release (> 0).
        min_cohort: cohort floor (>= 2): fewer survivors -> suppressed envelope, no noise
            drawn.
        secagg_threshold: Shamir threshold as a fraction of a node's share holders
            (raised to a strict majority, at least 2).
        neighbour_degree: None = complete graph; an even degree = SecAgg+ graph.
        quantisation_levels: Q of the fixed-point quantiser.
        seed: None = OpenDP's sampler; an int = seeded numpy noise per (round, metric)
            (reproducible simulation, recorded as ``seeded-simulation``).
        timeout: seconds to wait for each protocol step's replies.

    Raises:
        ValueError: no metrics, duplicate metric names, ``min_cohort < 2``.
    """

    def __init__(self, strategy: Strategy, *, metrics: Sequence[MetricSpec], epsilon: float,
                 min_cohort: int = 5, secagg_threshold: float = 0.6,
                 neighbour_degree: int | None = None, quantisation_levels: int = 2**16 - 1,
                 seed: int | None = None, timeout: float = 600.0) -> None:
        specs = list(metrics)
        if not specs:
            raise ValueError("metrics: at least one MetricSpec is needed")
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("metrics: metric names must be distinct")
        if isinstance(min_cohort, bool) or int(min_cohort) < 2:
            raise ValueError("min_cohort: must be an integer >= 2")
        if not 0.5 < secagg_threshold <= 1.0:
            raise ValueError("secagg_threshold: must be in (0.5, 1]")
        self.strategy = strategy
        self.metrics = specs
        self.epsilon = float(epsilon)
        self.min_cohort = int(min_cohort)
        self.secagg_threshold = float(secagg_threshold)
        self.neighbour_degree = neighbour_degree
        self.quantisation_levels = int(quantisation_levels)
        self.seed = seed
        self.timeout = float(timeout)
        self.quantiser = FixedPointQuantiser([s.clip_low for s in specs],
                                             [s.clip_high for s in specs],
                                             self.quantisation_levels)
        self.releases: dict[int, dict[str, AggregatedMetric]] = {}
        self.envelopes: dict[int, dict[str, str]] = {}
        self.protocol: dict[int, dict[str, Any]] = {}
        self._grid: Grid | None = None
        self._server: SecAggServer | None = None
        self._sid: dict[int, int] = {}
        self._node: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:  # e.g. strategy.cohort_history
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    # ---------------------------------------------------------------- delegation
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()
        log(20, "\t└──> PrivateEvaluation: metrics=%s, epsilon=%s each, min_cohort=%d",
            [s.name for s in self.metrics], self.epsilon, self.min_cohort)

    # ---------------------------------------------------------------- protocol
    def _send(self, msgs: list[Message]) -> list[Message]:
        assert self._grid is not None
        replies = self._grid.send_and_receive(msgs, timeout=self.timeout)
        return [r for r in replies if not r.has_error()]

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Step 1 (advertise keys), on the wrapped strategy's evaluate messages."""
        inner = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        self._grid = grid
        self._server = None
        ids = sorted(m.metadata.dst_node_id for m in inner)
        if len(ids) < 2:
            return []
        complete = self.neighbour_degree is None or self.neighbour_degree >= len(ids) - 1
        holders = len(ids) if complete else int(self.neighbour_degree) + 1
        cfg = SecAggConfig(
            n_clients=len(ids), threshold=_threshold(self.secagg_threshold, holders),
            vector_length=len(self.metrics), quantisation_levels=self.quantisation_levels,
            neighbour_degree=None if complete else self.neighbour_degree,
            round_id=f"flower-eval-{server_round}", graph_seed=int(server_round))
        # protocol ids 1..n (Flower node ids are unsigned 64-bit; the protocol packs int64)
        self._sid = {node: i + 1 for i, node in enumerate(ids)}
        self._node = {i: node for node, i in self._sid.items()}
        self._server = SecAggServer(cfg, sorted(self._node))
        record = {
            "secagg-config": cfg.model_dump_json(),
            "metric-names": [s.name for s in self.metrics],
            "clip-low": [float(s.clip_low) for s in self.metrics],
            "clip-high": [float(s.clip_high) for s in self.metrics],
        }
        out = []
        for m in inner:
            content = RecordDict(dict(m.content.items()))
            content[_CFG] = ConfigRecord({**record, "secagg-id": self._sid[m.metadata.dst_node_id]})
            out.append(Message(content=content, message_type=f"evaluate.{STEPS[0]}",
                               dst_node_id=m.metadata.dst_node_id))
        return out

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """Steps 2-4 through the grid, then DP noise once per metric and envelopes."""
        server = self._server
        if server is None:
            return None
        info: dict[str, Any] = {"advertised": 0, "survivors": 0, "dropped": 0, "aborted": None}
        self.protocol[server_round] = info
        sid, node = self._sid, self._node
        try:
            adverts = []
            for r in replies:
                if r.has_error():
                    continue
                rec = r.content[_CFG]
                adverts.append(AdvertiseKeys(sid[r.metadata.src_node_id], rec["c-pk"],
                                             rec["s-pk"]))
            info["advertised"] = len(adverts)
            rosters = server.collect_advertisements(adverts)
            step2 = [Message(content=RecordDict({_CFG: ConfigRecord({
                "roster-ids": sorted(ro), "roster-c-pk": [ro[v].c_pk for v in sorted(ro)],
                "roster-s-pk": [ro[v].s_pk for v in sorted(ro)],
                "neighbours": list(server.neighbours[u])})}),
                message_type=f"evaluate.{STEPS[1]}", dst_node_id=node[u])
                for u, ro in sorted(rosters.items())]
            shares = []
            for r in self._send(step2):
                rec = r.content[_CFG]
                u = sid[r.metadata.src_node_id]
                shares.append(ShareKeys(u, tuple(
                    EncryptedShare(u, int(v), bytes(ct))
                    for v, ct in zip(rec["recipients"], rec["ciphertexts"], strict=True))))
            inbox = server.route_shares(shares)
            step3 = [Message(content=RecordDict({_CFG: ConfigRecord({
                "senders": [s.sender for s in box], "ciphertexts": [s.ciphertext for s in box],
            })}), message_type=f"evaluate.{STEPS[2]}", dst_node_id=node[u])
                for u, box in sorted(inbox.items())]
            masked = [MaskedInput(sid[r.metadata.src_node_id],
                                  np.asarray(r.content[_CFG]["masked"], dtype=np.uint64))
                      for r in self._send(step3)]
            request = server.collect_masked_inputs(masked)
            step4 = [Message(content=RecordDict({_CFG: ConfigRecord({
                "survivors": sorted(request.survivors), "dropped": sorted(request.dropped),
            })}), message_type=f"evaluate.{STEPS[3]}", dst_node_id=node[u])
                for u in sorted(request.survivors)]
            responses = []
            for r in self._send(step4):
                rec = r.content[_CFG]
                responses.append(UnmaskingResponse(
                    sid[r.metadata.src_node_id],
                    {int(o): (int(i), bytes(s)) for o, i, s in
                     zip(rec["b-owners"], rec["b-index"], rec["b-shares"], strict=True)},
                    {int(o): (int(i), bytes(a), bytes(b)) for o, i, a, b in
                     zip(rec["k-owners"], rec["k-index"], rec["k-a"], rec["k-b"], strict=True)}))
            result = server.finalize(responses)
        except SecAggAbort as exc:
            info["aborted"] = str(exc)
            log(30, "private evaluation round %s not released: %s", server_round, exc)
            return None
        info.update(survivors=result.contributors, dropped=len(result.dropped))
        sums = self.quantiser.dequantise_sum(result.sum_quantised, result.contributors)
        return self._release(server_round, sums, result.contributors)

    def _release(self, server_round: int, sums: np.ndarray, n: int) -> MetricRecord | None:
        releases: dict[str, AggregatedMetric] = {}
        envelopes: dict[str, str] = {}
        published = MetricRecord()
        for j, spec in enumerate(self.metrics):
            rng = None if self.seed is None else np.random.default_rng(
                [int(self.seed), int(server_round), j])
            lo, hi = float(spec.clip_low), float(spec.clip_high)
            try:
                agg = aggregate_sum(float(sums[j]), n, spec, epsilon=self.epsilon,
                                    min_cohort=self.min_cohort, seed=rng)
            except BelowCohortFloor:
                envelopes[spec.name] = build_federated_metric_envelope(
                    metric_id=spec.name, metric_kind="bounded_mean", aggregate_value=lo,
                    clipping_lower_bound=lo, clipping_upper_bound=hi,
                    privacy_mechanism="laplace", privacy_mechanism_version="v1",
                    participant_count=n, minimum_group_size=self.min_cohort).to_json()
                continue
            value = float(np.clip(agg.value, lo, hi))
            bar = agg.published_error_bar
            releases[spec.name] = agg
            envelopes[spec.name] = build_federated_metric_envelope(
                metric_id=spec.name, metric_kind="bounded_mean", aggregate_value=value,
                clipping_lower_bound=lo, clipping_upper_bound=hi, privacy_mechanism="laplace",
                privacy_mechanism_version="v1", participant_count=n,
                minimum_group_size=self.min_cohort, uncertainty_method="confidence_interval",
                uncertainty_lower_bound=max(lo, value - bar),
                uncertainty_upper_bound=min(hi, value + bar), confidence_level=agg.level,
            ).to_json()
            published[spec.name] = value
            published[f"{spec.name}.error-bar"] = float(bar)
        self.releases[server_round] = releases
        self.envelopes[server_round] = envelopes
        return published if releases else None


# -------------------------------------------------------------------- node side
def _save(context: Context, client: SecAggClient, q: np.ndarray) -> None:
    roster = client._roster
    held = client._held
    owners = sorted(held)
    context.state.config_records[_STATE] = ConfigRecord({
        "config": client.config.model_dump_json(),
        "c-sk": client._c_sk.private_bytes_raw(), "s-sk": client._s_sk.private_bytes_raw(),
        "b": client._b, "neighbours": list(client._neighbours), "secagg-id": client.id,
        "roster-ids": sorted(roster), "roster-c-pk": [roster[v].c_pk for v in sorted(roster)],
        "roster-s-pk": [roster[v].s_pk for v in sorted(roster)],
        "held-owners": owners, "held-index": [int(held[o][0]) for o in owners],
        "held-b": [held[o][1] for o in owners], "held-sa": [held[o][2] for o in owners],
        "held-sb": [held[o][3] for o in owners], "q": [int(x) for x in q],
    })


def _load(context: Context) -> tuple[SecAggClient, np.ndarray]:
    rec = context.state.config_records[_STATE]
    cfg = SecAggConfig.model_validate(json.loads(str(rec["config"])))
    client = SecAggClient(int(rec["secagg-id"]), cfg)
    client._c_sk = X25519PrivateKey.from_private_bytes(bytes(rec["c-sk"]))
    client._s_sk = X25519PrivateKey.from_private_bytes(bytes(rec["s-sk"]))
    client._b = bytes(rec["b"])
    client._neighbours = tuple(int(v) for v in rec["neighbours"])
    client._roster = {int(v): AdvertiseKeys(int(v), bytes(c), bytes(s)) for v, c, s in
                      zip(rec["roster-ids"], rec["roster-c-pk"], rec["roster-s-pk"], strict=True)}
    client._held = {int(o): (int(i), bytes(b), bytes(a), bytes(c)) for o, i, b, a, c in
                    zip(rec["held-owners"], rec["held-index"], rec["held-b"], rec["held-sa"],
                        rec["held-sb"], strict=True)}
    return client, np.asarray(rec["q"], dtype=np.uint64)


def register_private_evaluation(
    app: ClientApp, metrics_fn: Callable[[Message, Context], Mapping[str, float]]
) -> ClientApp:
    """Register the four protocol steps of :class:`PrivateEvaluation` on ``app``.

    ``metrics_fn(message, context)`` computes this node's metrics on its local data for
    the model in ``message`` (name -> float, every name the server asks for); the values
    are clipped to the server's bounds and quantised on the device, and leave it only
    masked. Returns ``app``.
    """

    def _reply(msg: Message, rec: dict[str, Any]) -> Message:
        return Message(content=RecordDict({_CFG: ConfigRecord(rec)}), reply_to=msg)

    @app.evaluate(STEPS[0])
    def advertise_keys(msg: Message, context: Context) -> Message:
        rec = msg.content[_CFG]
        cfg = SecAggConfig.model_validate(json.loads(str(rec["secagg-config"])))
        names = list(rec["metric-names"])
        values = metrics_fn(msg, context)
        missing = [n for n in names if n not in values]
        if missing:
            raise ValueError(f"metrics_fn: no value for metric(s) {missing}")
        quantiser = FixedPointQuantiser(list(rec["clip-low"]), list(rec["clip-high"]),
                                        cfg.quantisation_levels)
        q = quantiser.quantise([float(values[n]) for n in names])  # clips first
        client = SecAggClient(int(rec["secagg-id"]), cfg)
        _save(context, client, q)
        adv = client.advertise()
        return _reply(msg, {"c-pk": adv.c_pk, "s-pk": adv.s_pk})

    @app.evaluate(STEPS[1])
    def share_keys(msg: Message, context: Context) -> Message:
        rec = msg.content[_CFG]
        client, q = _load(context)
        roster = {int(v): AdvertiseKeys(int(v), bytes(c), bytes(s)) for v, c, s in
                  zip(rec["roster-ids"], rec["roster-c-pk"], rec["roster-s-pk"], strict=True)}
        out = client.share_keys(roster, [int(v) for v in rec["neighbours"]])
        _save(context, client, q)
        return _reply(msg, {"recipients": [s.recipient for s in out.shares],
                            "ciphertexts": [s.ciphertext for s in out.shares]})

    @app.evaluate(STEPS[2])
    def masked_input(msg: Message, context: Context) -> Message:
        rec = msg.content[_CFG]
        client, q = _load(context)
        client.receive_shares([EncryptedShare(int(s), client.id, bytes(ct)) for s, ct in
                               zip(rec["senders"], rec["ciphertexts"], strict=True)])
        masked = client.masked_input(q)
        _save(context, client, q)
        return _reply(msg, {"masked": [int(x) for x in masked.masked]})

    @app.evaluate(STEPS[3])
    def unmasking(msg: Message, context: Context) -> Message:
        rec = msg.content[_CFG]
        client, _ = _load(context)
        resp = client.unmask(UnmaskingRequest(frozenset(int(v) for v in rec["survivors"]),
                                              frozenset(int(v) for v in rec["dropped"])))
        del context.state.config_records[_STATE]  # the round is over: forget its secrets
        b_owners = sorted(resp.self_mask_shares)
        k_owners = sorted(resp.key_shares)
        return _reply(msg, {
            "b-owners": b_owners,
            "b-index": [resp.self_mask_shares[o][0] for o in b_owners],
            "b-shares": [resp.self_mask_shares[o][1] for o in b_owners],
            "k-owners": k_owners,
            "k-index": [resp.key_shares[o][0] for o in k_owners],
            "k-a": [resp.key_shares[o][1] for o in k_owners],
            "k-b": [resp.key_shares[o][2] for o in k_owners],
        })

    return app
