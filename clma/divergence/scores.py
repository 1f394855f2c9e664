"""Layer and hierarchical divergence, robust z-scores, and per-round client scoring.

Representation signal (arXiv:2605.22266, Pérez-Corral et al., 2026, Sec. 3-4):

* layer divergence ``d_l = ||K_l^a - K_l^b||_F / P`` between two models' ``(P, P)`` affinity
  matrices on the same probe set;
* hierarchical divergence ``D_hier = d_1 + sum_{l>=2} (prod_{r<l} lambda_r) d_l`` with
  ``lambda_r = exp(-beta d_r)``: early layers, which set the coarse partition, weigh most;
* robust z-score across the clients of a round, ``(D_c - median) / (1.4826 * MAD)``; clients
  with ``z > z_threshold`` are flagged as atypical.

Parameter-space baseline: cosine distance of each client's update to the mean update, with
the same robust z and flagging, so both signals can be compared on the same runs.

Normalisation of ``d_l``: dividing the Frobenius norm by ``P`` makes ``d_l`` the root mean
square of ``K^a - K^b`` over all ``P**2`` ordered probe pairs. ``d_l`` is then in ``[0, 1]``
and does not grow with the probe size: duplicating every probe sample leaves it unchanged
exactly, and for i.i.d. probes ``d_l**2 * P / (P - 1)`` is an unbiased estimate of the mean
squared affinity change over pairs of distinct inputs, whatever ``P`` (the diagonal of
``K^a - K^b`` is always 0, hence the ``(P - 1) / P`` factor: 0.998 at ``P = 512``). So ``beta``
has the same meaning for any probe size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from scipy import stats
from torch import nn

from clma.divergence.affinity import affinities as _affinities
from clma.divergence.patterns import activation_patterns, probe_digest

__all__ = [
    "ClientId",
    "DivergenceConfig",
    "DivergenceReport",
    "RepresentationScorer",
    "RobustZ",
    "build_report",
    "combine_layer_divergences",
    "cosine_distance_to_mean",
    "hierarchical_divergence",
    "layer_divergence",
    "parameter_baseline",
    "robust_z",
    "robust_z_stats",
]

ClientId = int | str

#: ``sqrt(pi/2)``: ``E|X - mu| = sigma * sqrt(2/pi)`` for a normal X, so ``1.2533 * mean AD``
#: estimates sigma (the fallback scale of Iglewicz & Hoaglin's modified z-score).
MEAN_AD_NORMAL_SCALE = math.sqrt(math.pi / 2.0)
MIN_CLIENTS_FOR_Z = 3


# --------------------------------------------------------------------------- divergences


def _check_affinity(k: object, field: str) -> np.ndarray:
    if not isinstance(k, np.ndarray):
        raise TypeError(f"{field} must be a numpy array")
    if k.ndim != 2 or k.shape[0] != k.shape[1] or k.shape[0] < 1:
        raise ValueError(f"{field} must be a non-empty square (P, P) matrix")
    if k.dtype.kind not in "fiu":
        raise TypeError(f"{field} must hold real numbers")
    if not np.isfinite(k).all():
        raise ValueError(f"{field} must be finite (no NaN or inf)")
    return k


def _check_beta(beta: object) -> float:
    if isinstance(beta, bool) or not isinstance(beta, int | float | np.floating | np.integer):
        raise TypeError("beta must be a real number")
    beta = float(beta)
    if not math.isfinite(beta) or beta < 0:
        raise ValueError("beta must be finite and >= 0")
    return beta


def layer_divergence(k_a: np.ndarray, k_b: np.ndarray) -> float:
    """Layer divergence ``d_l = ||K_a - K_b||_F / P`` (root mean square over probe pairs).

    Args:
        k_a, k_b: ``(P, P)`` real affinity matrices of the same layer of two models on the
            same probe set.

    Returns:
        ``d_l >= 0``; in ``[0, 1]`` for affinity matrices (entries in ``[0, 1]``). Invariant to
        a common permutation of the probe samples and to duplicating the probe set.

    Raises:
        TypeError / ValueError: non-arrays, non-square or differently shaped matrices,
            non-finite entries.

    Source: arXiv:2605.22266, Sec. 3 (Frobenius layer divergence), normalised by ``P`` here.
    """
    k_a = _check_affinity(k_a, "k_a")
    k_b = _check_affinity(k_b, "k_b")
    if k_a.shape != k_b.shape:
        raise ValueError("k_a and k_b must have the same shape (same probe set)")
    diff = k_a.astype(np.float64, copy=False) - k_b.astype(np.float64, copy=False)
    return float(np.linalg.norm(diff, "fro") / k_a.shape[0])


def combine_layer_divergences(layer_divergences: Sequence[float], *, beta: float) -> float:
    """``D_hier = d_1 + sum_{l=2..L} (prod_{r<l} exp(-beta d_r)) d_l`` from layer divergences.

    Args:
        layer_divergences: ``(L,)`` finite, non-negative ``d_l``, first layer first, L >= 1.
        beta: attenuation, finite and >= 0 (0 gives the plain sum of ``d_l``).

    Raises:
        TypeError / ValueError: empty, negative or non-finite divergences; bad ``beta``.
    """
    beta = _check_beta(beta)
    d = np.asarray(layer_divergences, dtype=np.float64)
    if d.ndim != 1 or d.size < 1:
        raise ValueError("layer_divergences must be a non-empty 1-D sequence")
    if not np.isfinite(d).all() or (d < 0).any():
        raise ValueError("layer_divergences must be finite and >= 0")
    # weight of layer l is exp(-beta * sum_{r<l} d_r); the first layer's weight is 1
    prefix = np.concatenate(([0.0], np.cumsum(d)[:-1]))
    return float(np.sum(np.exp(-beta * prefix) * d))


def hierarchical_divergence(
    affinities_a: Sequence[np.ndarray],
    affinities_b: Sequence[np.ndarray],
    *,
    beta: float,
) -> float:
    """Hierarchical divergence between two models from their per-layer affinity matrices.

    ``D_hier = d_1 + sum_{l=2..L} (prod_{r<l} lambda_r) d_l``, ``lambda_r = exp(-beta d_r)``,
    ``d_l = ||K_l^a - K_l^b||_F / P`` (see :func:`layer_divergence`).

    Args:
        affinities_a, affinities_b: lists of ``(P, P)`` affinity matrices, first layer first,
            of equal length ``L >= 1`` and matching shapes layer by layer.
        beta: attenuation, finite and >= 0 (``beta = 0``: every ``lambda_r = 1``).

    Returns:
        ``D_hier >= 0`` (float).

    Raises:
        TypeError / ValueError: different numbers of layers, no layers, mismatched or
            non-square shapes, non-finite entries, negative or non-finite ``beta``.

    Source: arXiv:2605.22266, Sec. 3 (hierarchical divergence).
    """
    beta = _check_beta(beta)
    if isinstance(affinities_a, np.ndarray) or isinstance(affinities_b, np.ndarray):
        raise TypeError("affinities_a and affinities_b must be lists of (P, P) arrays")
    if len(affinities_a) != len(affinities_b):
        raise ValueError("affinities_a and affinities_b must have the same number of layers")
    if len(affinities_a) == 0:
        raise ValueError("affinities_a and affinities_b must hold at least one layer")
    d = []
    for layer, (k_a, k_b) in enumerate(zip(affinities_a, affinities_b, strict=True)):
        _check_affinity(k_a, f"affinities_a[{layer}]")
        _check_affinity(k_b, f"affinities_b[{layer}]")
        if k_a.shape != k_b.shape:
            raise ValueError(f"affinities_a[{layer}] and affinities_b[{layer}] differ in shape")
        d.append(layer_divergence(k_a, k_b))
    return combine_layer_divergences(d, beta=beta)


# --------------------------------------------------------------------------- robust z


class RobustZ(NamedTuple):
    """Robust z-scores and the statistics behind them.

    ``z``: ``(n,)`` float64; ``median``; ``mad``: raw median absolute deviation (unscaled);
    ``scale``: the denominator actually used; ``rule``: which rule chose it
    (``"mad"``, ``"mean_absolute_deviation"``, ``"constant"`` or ``"too_few_clients"``).
    """

    z: np.ndarray
    median: float
    mad: float
    scale: float
    rule: str


def robust_z_stats(scores: np.ndarray | Sequence[float]) -> RobustZ:
    """Robust z-scores ``(x - median) / scale`` with the rule used for ``scale``.

    Rules, in order:

    * fewer than 3 scores (``n < 3``): median and spread are not meaningful; ``z`` is all NaN
      (nobody can be flagged), ``scale`` NaN, rule ``"too_few_clients"``;
    * ``MAD > 0``: ``scale = 1.482602... * MAD`` (``1 / Phi^{-1}(3/4)``, scipy's
      ``median_abs_deviation(scale="normal")``; the usual "1.4826"), rule ``"mad"``;
    * ``MAD == 0`` (more than half the scores equal the median) but some score differs:
      ``scale = sqrt(pi/2) * mean|x - median|`` (1.2533 x mean absolute deviation, the
      fallback of Iglewicz & Hoaglin's modified z-score), rule ``"mean_absolute_deviation"``;
    * all scores equal: ``z`` all 0, ``scale`` 0, rule ``"constant"``.

    ``z`` is therefore always finite for ``n >= 3``.

    Args:
        scores: ``(n,)`` finite real scores.

    Raises:
        TypeError / ValueError: not 1-D real, or non-finite values.

    Source: Hampel (1974) / Iglewicz & Hoaglin (1993), "How to Detect and Handle Outliers".
    """
    x = np.asarray(scores)
    if x.dtype.kind not in "fiu" or x.dtype == np.bool_:
        raise TypeError("scores must be real numbers")
    if x.ndim != 1:
        raise ValueError("scores must be a 1-D array (one score per client)")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise ValueError("scores must be finite (no NaN or inf)")
    n = x.size
    if n == 0:
        return RobustZ(np.empty(0), math.nan, math.nan, math.nan, "too_few_clients")
    median = float(np.median(x))
    mad = float(stats.median_abs_deviation(x, scale=1.0))
    if n < MIN_CLIENTS_FOR_Z:
        return RobustZ(np.full(n, math.nan), median, mad, math.nan, "too_few_clients")
    if mad > 0:
        scale = float(stats.median_abs_deviation(x, scale="normal"))
        rule = "mad"
    else:
        scale = MEAN_AD_NORMAL_SCALE * float(np.mean(np.abs(x - median)))
        rule = "mean_absolute_deviation"
        if scale == 0:
            return RobustZ(np.zeros(n), median, mad, 0.0, "constant")
    return RobustZ((x - median) / scale, median, mad, scale, rule)


def robust_z(scores: np.ndarray | Sequence[float]) -> np.ndarray:
    """Robust z-scores ``(x - median) / (1.4826 * MAD)``: ``(n,)`` float64.

    See :func:`robust_z_stats` for the rules when ``MAD == 0`` (mean-absolute-deviation
    fallback, zeros when all scores are equal) and when ``n < 3`` (all NaN: nobody flagged).
    """
    return robust_z_stats(scores).z


# --------------------------------------------------------------------------- report


def _finite_or_none(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


class DivergenceReport(BaseModel):
    """One round's atypical-client scores for one signal.

    Attributes:
        method: ``"representation"`` (hierarchical divergence to the reference model) or
            ``"parameter_cosine"`` (cosine distance of the update to the mean update).
        scores: client id -> divergence ``D_c`` (float).
        z: client id -> robust z (NaN when fewer than 3 clients take part).
        flagged: clients with ``z > z_threshold``, sorted (ints before strings).
        median, mad: median and raw (unscaled) MAD of the scores.
        scale: denominator of the z-scores (``1.4826 * mad`` unless a fallback applied).
        scale_rule: rule that chose ``scale`` (see :func:`robust_z_stats`).
        max_z: largest z (NaN when undefined).
        z_threshold: flagging threshold used.
        beta: attenuation used (representation signal only).
        layer_divergences: client id -> per-layer ``d_l`` (representation signal only).
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=False)

    method: Literal["representation", "parameter_cosine"]
    scores: dict[ClientId, float]
    z: dict[ClientId, float]
    flagged: list[ClientId]
    median: float
    mad: float
    scale: float
    scale_rule: Literal["mad", "mean_absolute_deviation", "constant", "too_few_clients"]
    max_z: float
    z_threshold: float
    beta: float | None = None
    layer_divergences: dict[ClientId, list[float]] = Field(default_factory=dict)

    @property
    def n_flagged(self) -> int:
        """Number of flagged clients."""
        return len(self.flagged)

    def to_dict(self) -> dict:
        """JSON-able dict: client ids become strings, NaN/inf become ``None``."""
        return {
            "method": self.method,
            "scores": {str(k): _finite_or_none(v) for k, v in self.scores.items()},
            "z": {str(k): _finite_or_none(v) for k, v in self.z.items()},
            "flagged": [str(c) for c in self.flagged],
            "n_flagged": self.n_flagged,
            "median": _finite_or_none(self.median),
            "mad": _finite_or_none(self.mad),
            "scale": _finite_or_none(self.scale),
            "scale_rule": self.scale_rule,
            "max_z": _finite_or_none(self.max_z),
            "z_threshold": self.z_threshold,
            "beta": self.beta,
            "layer_divergences": {
                str(k): [float(x) for x in v] for k, v in self.layer_divergences.items()
            },
        }


def _sort_key(c: ClientId) -> tuple[int, int | str]:
    return (1, c) if isinstance(c, str) else (0, c)


def _check_client_id(c: object) -> ClientId:
    if isinstance(c, bool) or not isinstance(c, int | str | np.integer):
        raise TypeError("client ids must be int or str")
    return int(c) if isinstance(c, np.integer) else c


def build_report(
    method: Literal["representation", "parameter_cosine"],
    client_ids: Sequence[ClientId],
    scores: np.ndarray,
    z_threshold: float,
    beta: float | None = None,
    layer_divergences: dict[ClientId, list[float]] | None = None,
) -> DivergenceReport:
    """A :class:`DivergenceReport` from per-client scores ``(n,)`` (same order as
    ``client_ids``): robust z across them (:func:`robust_z_stats`), flagged where
    ``z > z_threshold`` (NaN z, fewer than 3 clients, never flags)."""
    rz = robust_z_stats(scores)
    flagged = sorted(
        (c for c, zc in zip(client_ids, rz.z, strict=True) if zc > z_threshold), key=_sort_key
    )
    max_z = float(np.max(rz.z)) if rz.z.size and np.isfinite(rz.z).all() else math.nan
    return DivergenceReport(
        method=method,
        scores={c: float(s) for c, s in zip(client_ids, scores, strict=True)},
        z={c: float(zc) for c, zc in zip(client_ids, rz.z, strict=True)},
        flagged=flagged,
        median=rz.median,
        mad=rz.mad,
        scale=rz.scale,
        scale_rule=rz.rule,
        max_z=max_z,
        z_threshold=z_threshold,
        beta=beta,
        layer_divergences=layer_divergences or {},
    )


# --------------------------------------------------------------------------- scorers


class DivergenceConfig(BaseModel):
    """Settings of the representation-level scorer.

    ``beta``: attenuation of deeper layers (finite, >= 0); ``z_threshold``: flag clients with
    robust z strictly above it (finite, > 0); ``batch_size``: probe samples per forward pass.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    beta: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    z_threshold: float = Field(3.0, gt=0.0, allow_inf_nan=False)
    batch_size: int = Field(256, ge=1)


def _check_z_threshold(z_threshold: object) -> float:
    if isinstance(z_threshold, bool) or not isinstance(
        z_threshold, int | float | np.integer | np.floating
    ):
        raise TypeError("z_threshold must be a real number")
    z_threshold = float(z_threshold)
    if not math.isfinite(z_threshold) or z_threshold <= 0:
        raise ValueError("z_threshold must be finite and > 0")
    return z_threshold


class RepresentationScorer:
    """Per-round representation-level divergence of every client to a reference model.

    For each client ``c``: ``D_c = hierarchical_divergence(K(reference), K(local_c), beta)``
    over the ReLU layers on the fixed probe set, then robust z across the clients and
    ``z > z_threshold`` flags ``c`` as atypical (arXiv:2605.22266, Sec. 3-4).

    Args:
        probe: ``(P, *input_shape)`` fixed probe set, shared by the federation; its SHA-256
            is :attr:`probe_sha256` (record it with the run).
        beta: attenuation, finite and >= 0.
        z_threshold: flagging threshold, finite and > 0.
        batch_size: probe samples per forward pass.
        model_factory: zero-argument callable building a model of the federation's
            architecture; needed only when clients are passed as ``(n_params,)`` float32
            parameter vectors (``torch.nn.utils.parameters_to_vector`` order). Vectors carry
            parameters only: buffers (e.g. BatchNorm running statistics) are those of the
            factory's model.

    Raises:
        ValueError / TypeError: bad probe or settings (pydantic ``ValidationError`` is a
            ``ValueError``).
    """

    def __init__(
        self,
        probe: np.ndarray | torch.Tensor,
        beta: float = 1.0,
        z_threshold: float = 3.0,
        *,
        batch_size: int = 256,
        model_factory: Callable[[], nn.Module] | None = None,
    ) -> None:
        self.config = DivergenceConfig(beta=beta, z_threshold=z_threshold, batch_size=batch_size)
        if isinstance(probe, torch.Tensor):
            probe = probe.detach().cpu().numpy()
        probe = np.asarray(probe)
        if probe.ndim < 2 or probe.shape[0] < 2:
            raise ValueError("probe must have shape (n_probe, *input_shape) with n_probe >= 2")
        if probe.dtype.kind not in "fiu" or not np.isfinite(probe).all():
            raise ValueError("probe must be finite real numbers")
        self.probe = np.ascontiguousarray(probe, dtype=np.float32)
        self.probe_sha256 = probe_digest(self.probe)
        if model_factory is not None and not callable(model_factory):
            raise TypeError("model_factory must be a zero-argument callable")
        self.model_factory = model_factory
        self._scratch: nn.Module | None = None

    @classmethod
    def from_config(
        cls,
        probe: np.ndarray | torch.Tensor,
        config: DivergenceConfig,
        *,
        model_factory: Callable[[], nn.Module] | None = None,
    ) -> RepresentationScorer:
        """Build a scorer from a :class:`DivergenceConfig`."""
        return cls(
            probe,
            beta=config.beta,
            z_threshold=config.z_threshold,
            batch_size=config.batch_size,
            model_factory=model_factory,
        )

    @property
    def n_probe(self) -> int:
        """Probe size P."""
        return int(self.probe.shape[0])

    def layer_affinities(self, model: nn.Module | np.ndarray) -> list[np.ndarray]:
        """``(P, P)`` float64 affinity matrix of every ReLU layer of ``model`` on the probe."""
        model = self._as_module(model)
        patterns = activation_patterns(model, self.probe, batch_size=self.config.batch_size)
        return _affinities(patterns)

    def _as_module(self, model: nn.Module | np.ndarray, field: str = "model") -> nn.Module:
        if isinstance(model, nn.Module):
            return model
        if isinstance(model, np.ndarray | torch.Tensor):
            if self.model_factory is None:
                raise TypeError(f"{field} is a parameter vector: the scorer needs a model_factory")
            if self._scratch is None:
                self._scratch = self.model_factory()
            vec = torch.as_tensor(np.asarray(model, dtype=np.float32))
            n_params = sum(p.numel() for p in self._scratch.parameters())
            if vec.ndim != 1 or vec.numel() != n_params:
                raise ValueError(f"{field} must be a (n_params,) vector with n_params={n_params}")
            torch.nn.utils.vector_to_parameters(vec, self._scratch.parameters())
            return self._scratch
        raise TypeError(f"{field} must be a torch.nn.Module or a (n_params,) float32 vector")

    def score(
        self,
        reference_model: nn.Module | np.ndarray,
        client_models: Mapping[ClientId, nn.Module | np.ndarray],
    ) -> DivergenceReport:
        """Score every client against ``reference_model`` (global or cohort model).

        Args:
            reference_model: ``nn.Module`` or ``(n_params,)`` float32 vector (with
                ``model_factory``); its affinities are computed once per call.
            client_models: client id (int or str) -> local model (module or vector).

        Returns:
            A :class:`DivergenceReport` with ``method="representation"``, per-client ``D_c``,
            per-layer ``d_l``, robust z and the flagged set.

        Raises:
            TypeError / ValueError: bad ids or models, or a client whose ReLU layers differ
                in number or width from the reference's.
        """
        if not isinstance(client_models, Mapping):
            raise TypeError("client_models must be a mapping client id -> model")
        ref_aff = self.layer_affinities(self._as_module(reference_model, "reference_model"))
        ids: list[ClientId] = []
        scores: list[float] = []
        per_layer: dict[ClientId, list[float]] = {}
        for raw_id, model in client_models.items():
            cid = _check_client_id(raw_id)
            aff = self.layer_affinities(self._as_module(model, f"client_models[{cid!r}]"))
            if len(aff) != len(ref_aff):
                raise ValueError(
                    f"client {cid!r} has {len(aff)} ReLU layers, the reference has {len(ref_aff)}"
                )
            d = [layer_divergence(k_ref, k_c) for k_ref, k_c in zip(ref_aff, aff, strict=True)]
            ids.append(cid)
            per_layer[cid] = d
            scores.append(combine_layer_divergences(d, beta=self.config.beta))
        return build_report(
            "representation",
            ids,
            np.asarray(scores, dtype=np.float64),
            self.config.z_threshold,
            beta=self.config.beta,
            layer_divergences=per_layer,
        )


def cosine_distance_to_mean(
    updates: np.ndarray,
    *,
    weights: np.ndarray | Sequence[float] | None = None,
    leave_one_out: bool = False,
) -> np.ndarray:
    """Cosine distance ``1 - cos(u_c, u_bar)`` of each client's update to the mean update.

    ``u_bar`` is the mean of the rows (weighted by ``weights`` if given, e.g. example
    counts), including the client itself unless ``leave_one_out`` (then ``u_bar`` for client
    ``c`` is the mean of the *other* rows, so one large update cannot pull the mean towards
    itself). Computed in float64, one client at a time (memory ``O(n_params)`` beyond the
    input). A zero update, or a zero mean update, has no direction: its distance is defined
    as 1 (the value for orthogonal vectors).

    Args:
        updates: ``(n_clients, n_params)`` float stack of client updates (local - global).
        weights: optional ``(n_clients,)`` non-negative finite weights with positive sum.
        leave_one_out: exclude client ``c`` from the mean it is compared with (needs
            ``n_clients >= 2``).

    Returns:
        ``(n_clients,)`` float64 distances in ``[0, 2]``.

    Raises:
        TypeError / ValueError: not a 2-D real array, non-finite values, bad weights.
    """
    if not isinstance(updates, np.ndarray) or updates.dtype.kind != "f":
        raise TypeError("updates must be a floating numpy array (n_clients, n_params)")
    if updates.ndim != 2 or updates.shape[0] < 1 or updates.shape[1] < 1:
        raise ValueError("updates must be 2-D (n_clients, n_params) with at least one of each")
    if not np.isfinite(updates).all():
        raise ValueError("updates must be finite (no NaN or inf)")
    n = updates.shape[0]
    if weights is None:
        w = np.ones(n, dtype=np.float64)
    else:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (n,) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ValueError("weights must be (n_clients,) finite, >= 0, with a positive sum")
    if leave_one_out and n < 2:
        raise ValueError("leave_one_out needs at least 2 clients in updates")
    total = np.zeros(updates.shape[1], dtype=np.float64)
    for i in range(n):
        total += w[i] * updates[i]
    out = np.ones(n, dtype=np.float64)
    for i in range(n):
        u = updates[i].astype(np.float64)
        mean = total - w[i] * u if leave_one_out else total
        # the positive normaliser of the mean cancels in the cosine
        mean_norm = float(np.linalg.norm(mean))
        u_norm = float(np.linalg.norm(u))
        if u_norm > 0 and mean_norm > 0:
            cos = float(u @ mean) / (u_norm * mean_norm)
            out[i] = 1.0 - min(1.0, max(-1.0, cos))
    return out


def parameter_baseline(
    updates: np.ndarray,
    client_ids: Sequence[ClientId] | None = None,
    *,
    z_threshold: float = 3.0,
    weights: np.ndarray | Sequence[float] | None = None,
    leave_one_out: bool = False,
) -> DivergenceReport:
    """Parameter-space baseline: cosine distance to the mean update, robust z, flagging.

    Args:
        updates: ``(n_clients, n_params)`` float32 stack of client updates (local - global).
        client_ids: ``n_clients`` distinct ids (int or str), row order; default ``0..n-1``.
        z_threshold: flag clients with robust z strictly above it (finite, > 0).
        weights: optional ``(n_clients,)`` weights of the mean update.
        leave_one_out: compare each client with the mean of the others.

    Returns:
        A :class:`DivergenceReport` with ``method="parameter_cosine"``.

    Raises:
        TypeError / ValueError: see :func:`cosine_distance_to_mean`; ids of the wrong length
            or repeated.
    """
    z_threshold = _check_z_threshold(z_threshold)
    dist = cosine_distance_to_mean(updates, weights=weights, leave_one_out=leave_one_out)
    if client_ids is None:
        ids: list[ClientId] = list(range(updates.shape[0]))
    else:
        ids = [_check_client_id(c) for c in client_ids]
        if len(ids) != updates.shape[0]:
            raise ValueError("client_ids must have one id per row of updates")
    if len(set(ids)) != len(ids):
        raise ValueError("client_ids must be distinct")
    return build_report("parameter_cosine", ids, dist, z_threshold)
