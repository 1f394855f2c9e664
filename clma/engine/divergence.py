"""Atypical clients: score every client of a round (representation and parameter signals).

Two signals, computed on the same round from the same updates:

* **representation** (arXiv:2605.22266, Pérez-Corral et al. 2026, Sec. 3-4): ``D_c`` =
  hierarchical divergence between the activation-pattern affinities of client ``c``'s
  local model and of the model it started the round from (its cohort's start model), on
  the federation's fixed shared probe set (:attr:`ServerAssets.probe_x`); robust z across
  the round's clients (median / 1.4826 MAD, :func:`clma.divergence.robust_z_stats`);
  clients with ``z > divergence.z_threshold`` are flagged;
* **parameter baseline**: cosine distance of each client's update (``params - start
  model``) to the *leave-one-out* mean update of the other clients (unweighted), with the
  same robust z and threshold (:func:`clma.divergence.parameter_baseline` with
  ``leave_one_out=True``: without it one huge outlier drags the mean towards itself and
  can rank *lowest*).

``divergence.flag`` is the rule that flags a client within each signal
(:mod:`clma.divergence.flags`): ``one_sided`` (``z > z_threshold``), ``two_sided``
(``|z| > z_threshold``) or ``persistent`` (the default: ``|s| > persistence_threshold`` and
the robust z of ``s`` across the round's clients above ``z_threshold``, with ``s`` the EWMA
of the client's clipped z over the rounds it took part in; the state ``s``
per signal and client lives in :attr:`ServerState.divergence_persistence` and is updated
every scored round whatever the flag is). ``divergence.signal`` picks whose flags count
(:func:`flagged_under`): ``representation`` (default), ``parameter``, ``either`` (union) or
``both`` (intersection). That flagged set drives ``divergence.action``: ``report`` leaves aggregation unchanged (weights ``None``);
``downweight`` multiplies a flagged client's FedAvg weight by
``divergence.downweight_factor``; ``exclude`` sets it to 0.

Privacy: :meth:`DivergenceOutcome.summary` (what is published) holds distribution
statistics and counts only, never a client id. The full reports (client id -> score) stay
in memory on the server, which already sees individual updates (DESIGN.md, trust model).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clma.config import DivergenceConfig
from clma.divergence import (
    DivergenceReport,
    RepresentationScorer,
    build_report,
    flag_clients,
    parameter_baseline,
    update_persistence,
)
from clma.engine.state import ServerAssets
from clma.params import AllParams, vector_to_model
from clma.rounds import ClientUpdate

__all__ = [
    "DivergenceOutcome",
    "aggregation_weights",
    "flagged_by",
    "flagged_under",
    "score_divergence",
]


def _nan_to_none(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def _report_summary(rep: DivergenceReport, flagged: Sequence[int],
                    persistence: Mapping[int, float], cfg: DivergenceConfig
                    ) -> dict[str, Any]:
    """Distribution statistics of one report, without client ids (JSON-able).

    ``n_flagged``: flagged under ``divergence.flag``; ``n_flagged_one_sided`` /
    ``n_flagged_two_sided`` / ``n_persistent``: under each rule (counts: published as bands);
    ``persistence_max_abs``: the largest ``|s|`` among the round's clients."""
    z = {c: v for c, v in rep.z.items()}
    finite = [v for v in z.values() if math.isfinite(v)]
    s_round = [abs(persistence[int(c)]) for c in z if int(c) in persistence]
    kw = {"z_threshold": cfg.z_threshold, "persistence_threshold": cfg.persistence_threshold}
    return {
        "median": _nan_to_none(rep.median),
        "mad": _nan_to_none(rep.mad),
        "scale": _nan_to_none(rep.scale),
        "scale_rule": rep.scale_rule,
        "max_z": _nan_to_none(rep.max_z),
        "min_z": float(min(finite)) if finite and len(finite) == len(z) else None,
        "n_flagged": len(flagged),
        "n_flagged_one_sided": len(flag_clients("one_sided", z, persistence, **kw)),
        "n_flagged_two_sided": len(flag_clients("two_sided", z, persistence, **kw)),
        "n_persistent": len(flag_clients("persistent", z, persistence, **kw)),
        "persistence_max_abs": float(max(s_round)) if s_round else None,
        "n_clients": len(rep.scores),
        "z_threshold": rep.z_threshold,
    }


@dataclass(frozen=True)
class DivergenceOutcome:
    """One round's atypical-client scores (server side, in memory).

    Attributes:
        round: round number.
        action: ``report`` | ``downweight`` | ``exclude`` (from the config).
        signal: ``representation`` | ``parameter`` | ``either`` | ``both``: whose flags
            count (from the config).
        flag: ``one_sided`` | ``two_sided`` | ``persistent``: the rule within a signal.
        representation: representation-signal report (client id -> ``D_c``, z, flagged).
        parameter: parameter-baseline report (leave-one-out cosine distance, z, flagged).
        probe_sha256: :func:`clma.divergence.probe_digest` of the probe set used.
        weights: client id -> FedAvg weight multiplier for the flagged clients, or ``None``
            (action ``report``, or nobody flagged).
        cohorts: client id -> the cohort whose start model it was scored against.
        flag_sets: signal (``representation`` / ``parameter``) -> clients flagged under
            ``flag`` this round, sorted.
        persistence: signal -> client id -> EWMA ``s`` after this round (the server
            state's new :attr:`ServerState.divergence_persistence`; never published).
        config: the settings it was scored with (thresholds of the summary's counts).
    """

    round: int
    action: str
    signal: str
    representation: DivergenceReport
    parameter: DivergenceReport
    probe_sha256: str
    weights: dict[int, float] | None
    cohorts: dict[int, int]
    flag: str = "one_sided"
    flag_sets: dict[str, list[int]] | None = None
    persistence: dict[str, dict[int, float]] | None = None
    config: DivergenceConfig | None = field(default=None, repr=False)

    @property
    def flagged(self) -> list[int]:
        """Clients flagged under ``flag`` and ``signal`` (they drive ``action``), sorted."""
        if self.flag_sets is None:
            return flagged_by(self.signal, self.representation, self.parameter)
        return flagged_under(self.signal, self.flag_sets["representation"],
                             self.flag_sets["parameter"])

    def _sets(self, signal: str) -> list[int]:
        if self.flag_sets is None:
            rep = self.representation if signal == "representation" else self.parameter
            return [int(c) for c in rep.flagged]
        return self.flag_sets[signal]

    def summary(self) -> dict[str, Any]:
        """Id-free summary for the round record and MLflow (no client ids, counts only)."""
        cfg = self.config or DivergenceConfig()
        pers = self.persistence or {}
        return {
            "action": self.action,
            "signal": self.signal,
            "flag": self.flag,
            "n_flagged": len(self.flagged),
            "probe_sha256": self.probe_sha256,
            "representation": _report_summary(
                self.representation, self._sets("representation"),
                pers.get("representation", {}), cfg),
            "parameter": {**_report_summary(self.parameter, self._sets("parameter"),
                                            pers.get("parameter", {}), cfg),
                          "leave_one_out": True},
            "n_reweighted": 0 if self.weights is None else len(self.weights),
        }


def flagged_by(
    signal: str, representation: DivergenceReport, parameter: DivergenceReport
) -> list[int]:
    """Sorted client ids flagged under ``signal``, with each report's one-sided flags.

    ``representation`` / ``parameter``: that report's flagged set; ``either``: their union;
    ``both``: their intersection. Raises ``ValueError`` for another signal.
    """
    return flagged_under(signal, representation.flagged, parameter.flagged)


def flagged_under(signal: str, representation: Sequence[int], parameter: Sequence[int]
                  ) -> list[int]:
    """Sorted client ids flagged under ``signal`` from each signal's flagged clients.

    ``representation`` / ``parameter``: that set; ``either``: their union; ``both``: their
    intersection. Raises ``ValueError`` for another signal.
    """
    rep = {int(c) for c in representation}
    par = {int(c) for c in parameter}
    sets = {"representation": rep, "parameter": par, "either": rep | par, "both": rep & par}
    if signal not in sets:
        raise ValueError(
            "divergence.signal must be 'representation', 'parameter', 'either' or 'both'"
        )
    return sorted(sets[signal])


def aggregation_weights(
    flagged: Sequence[int], action: str, downweight_factor: float
) -> dict[int, float] | None:
    """FedAvg weight multipliers for the flagged clients under ``action``.

    ``report`` (or no flagged client) -> ``None`` (aggregation unchanged); ``downweight`` ->
    ``downweight_factor`` for each flagged client; ``exclude`` -> ``0.0``. Raises
    ``ValueError`` for another action.
    """
    if action not in ("report", "downweight", "exclude"):
        raise ValueError("divergence.action must be 'report', 'downweight' or 'exclude'")
    if action == "report" or not flagged:
        return None
    factor = 0.0 if action == "exclude" else float(downweight_factor)
    return {int(c): factor for c in flagged}


def _round_report(
    ids: list[int], scores: list[float], z_threshold: float, beta: float,
    per_layer: dict[int, list[float]],
) -> DivergenceReport:
    """Representation report with z taken across *all* the round's clients (all cohorts)."""
    return build_report("representation", ids, np.asarray(scores, dtype=np.float64),
                        z_threshold, beta, per_layer)


def score_divergence(
    settings: DivergenceConfig,
    assets: ServerAssets,
    updates: Sequence[ClientUpdate],
    start_models: Mapping[int, np.ndarray],
    round_number: int,
    persistence: Mapping[str, Mapping[int, float]] | None = None,
) -> DivergenceOutcome:
    """Score every client of the round (see the module docstring). Pure server-side step.

    Args:
        settings: the ``divergence`` section of the config (beta, z threshold, action,
            signal, down-weight factor).
        assets: the server's public assets (``probe_x`` ``(P, ...)`` float32 shared probe
            set, ``model_spec`` the architecture).
        updates: the round's client updates; ``params`` float32 ``(n_params,)`` full state
            (``AllParams`` order), ``cohort_id`` the cohort the client started from.
        start_models: cohort id -> float32 ``(n_params,)`` model the cohort's clients started
            this round from (before aggregation).
        round_number: the round (>= 1).
        persistence: signal -> client id -> EWMA ``s`` before this round (the server
            state's :attr:`ServerState.divergence_persistence`; ``None`` or empty: nobody
            seen yet). Not changed: the new state is the outcome's ``persistence``.

    Returns:
        :class:`DivergenceOutcome`. With fewer than 3 clients every z is NaN and nobody is
        flagged (:func:`clma.divergence.robust_z_stats`).

    Raises:
        ValueError: no updates, duplicate client ids, an update whose cohort has no start
            model, or a parameter vector of the wrong length.
    """
    cfg = settings
    if not updates:
        raise ValueError("updates: a round needs at least one client update to score")
    ids = [int(u.client_id) for u in updates]
    if len(set(ids)) != len(ids):
        raise ValueError("updates: client ids must be distinct")
    missing = sorted({u.cohort_id for u in updates} - set(start_models))
    if missing:
        raise ValueError("start_models: a client's cohort has no start model")

    scorer = RepresentationScorer(assets.probe_x, beta=cfg.beta, z_threshold=cfg.z_threshold)
    selector = AllParams()

    def module(vec: np.ndarray):
        return vector_to_model(vec, assets.model_spec.build(), selector)

    # representation: D_c against the client's own cohort start model (one reference per cohort)
    by_cohort: dict[int, list[ClientUpdate]] = defaultdict(list)
    for u in updates:
        by_cohort[u.cohort_id].append(u)
    score_of: dict[int, float] = {}
    per_layer: dict[int, list[float]] = {}
    for cohort, members in sorted(by_cohort.items()):
        rep = scorer.score(
            module(start_models[cohort]), {u.client_id: module(u.params) for u in members}
        )
        score_of.update({int(c): float(s) for c, s in rep.scores.items()})
        per_layer.update({int(c): list(v) for c, v in rep.layer_divergences.items()})
    representation = _round_report(
        ids, [score_of[c] for c in ids], cfg.z_threshold, cfg.beta, per_layer
    )

    # parameter baseline: update = local - start model, leave-one-out mean, same robust z
    stack = np.stack(
        [np.asarray(u.params, np.float32) - np.asarray(start_models[u.cohort_id], np.float32)
         for u in updates]
    )
    if len(ids) >= 2:
        parameter = parameter_baseline(
            stack, ids, z_threshold=cfg.z_threshold, leave_one_out=True
        )
    else:  # leave-one-out needs two clients; one client has no z anyway
        parameter = parameter_baseline(stack, ids, z_threshold=cfg.z_threshold)

    before = persistence or {}
    reports = {"representation": representation, "parameter": parameter}
    new_state = {
        sig: update_persistence(before.get(sig, {}), {int(c): v for c, v in rep.z.items()},
                                lam=cfg.persistence_lambda, clip=cfg.persistence_clip)
        for sig, rep in reports.items()}
    flag_sets = {
        sig: flag_clients(cfg.flag, {int(c): v for c, v in rep.z.items()}, new_state[sig],
                          z_threshold=cfg.z_threshold,
                          persistence_threshold=cfg.persistence_threshold)
        for sig, rep in reports.items()}
    return DivergenceOutcome(
        round=int(round_number),
        action=cfg.action,
        signal=cfg.signal,
        representation=representation,
        parameter=parameter,
        probe_sha256=scorer.probe_sha256,
        weights=aggregation_weights(
            flagged_under(cfg.signal, flag_sets["representation"], flag_sets["parameter"]),
            cfg.action, cfg.downweight_factor),
        cohorts={int(u.client_id): int(u.cohort_id) for u in updates},
        flag=cfg.flag,
        flag_sets=flag_sets,
        persistence=new_state,
        config=cfg,
    )
