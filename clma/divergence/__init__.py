"""Representation-level divergence: atypical clients from activation-pattern affinity.

Activation patterns on a fixed probe set (:mod:`.patterns`), per-layer activation affinity
(:mod:`.affinity`), layer and hierarchical divergence, robust z-scores, the per-round
:class:`RepresentationScorer` and the parameter-space cosine baseline (:mod:`.scores`).
Source: Pérez-Corral et al., "Detecting Atypical Clients in Federated Learning via
Representation-Level Divergence", arXiv:2605.22266 (2026).
"""

from clma.divergence.affinity import affinities, affinity
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
