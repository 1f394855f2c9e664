"""Representation-level divergence: atypical clients from activation-pattern affinity.

Activation patterns on a fixed probe set (:mod:`.patterns`), one-sided / two-sided /
persistence flags (:mod:`.flags`), per-layer activation affinity
(:mod:`.affinity`), layer and hierarchical divergence, robust z-scores, the per-round
:class:`RepresentationScorer` and the parameter-space cosine baseline (:mod:`.scores`).
Source: Pérez-Corral et al., "Detecting Atypical Clients in Federated Learning via
Representation-Level Divergence", arXiv:2605.22266 (2026).
"""

from clma.divergence.affinity import affinities, affinity
from clma.divergence.flags import (
    FLAG_KINDS,
    ewma_step,
    flag_clients,
    one_sided_flags,
    persistence_z,
    persistent_flags,
    two_sided_flags,
    update_persistence,
)
from clma.divergence.patterns import (
    LayerPattern,
    activation_patterns,
    probe_digest,
    sample_probe,
)
from clma.divergence.scores import (
    ClientId,
    DivergenceConfig,
    DivergenceReport,
    RepresentationScorer,
    RobustZ,
    build_report,
    combine_layer_divergences,
    cosine_distance_to_mean,
    hierarchical_divergence,
    layer_divergence,
    parameter_baseline,
    robust_z,
    robust_z_stats,
)

__all__ = [
    "FLAG_KINDS",
    "ewma_step",
    "flag_clients",
    "one_sided_flags",
    "persistence_z",
    "persistent_flags",
    "two_sided_flags",
    "update_persistence",
    "ClientId",
    "DivergenceConfig",
    "DivergenceReport",
    "LayerPattern",
    "RepresentationScorer",
    "build_report",
    "RobustZ",
    "activation_patterns",
    "affinities",
    "affinity",
    "combine_layer_divergences",
    "cosine_distance_to_mean",
    "hierarchical_divergence",
    "layer_divergence",
    "parameter_baseline",
    "probe_digest",
    "robust_z",
    "robust_z_stats",
    "sample_probe",
]
