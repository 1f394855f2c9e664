"""Releases: bounded metric specs, noisy aggregates, regional reports, alerts.

Public names (DESIGN.md "Public names"): ``MetricSpec``, ``aggregate_metric``,
``AggregatedMetric``, ``regional_report``; the envelope names are re-exported
below from ``clma.release.envelope``.
"""

from clma.release.aggregate import (
    AggregatedMetric,
    AggregatedVector,
    BelowCohortFloor,
    MetricSpec,
    ParticipantBand,
    RegionalReport,
    SuppressedRegionBand,
    SuppressedRelease,
    aggregate_metric,
    aggregate_sum,
    aggregate_vector_sum,
    count_band,
    participant_band,
    participant_band_lower_edge,
    region_seed,
    regional_report,
    suppressed_region_band,
)
from clma.release.alerts import (
    Alert,
    AlertBaseline,
    AlertBaselines,
    AlertEvaluation,
    AlertRule,
    evaluation_due,
    exceeds_combined_error_bars,
    minimum_detectable_shift,
)
from clma.release.bounds import (
    BoundProposal,
    BoundsVersion,
    RegionMergeTracker,
    merged_regional_report,
    propose_clip_bound,
    update_bounds,
)

__all__ = [
    "Alert",
    "AlertBaseline",
    "AlertBaselines",
    "AlertEvaluation",
    "AlertRule",
    "BoundProposal",
    "BoundsVersion",
    "RegionMergeTracker",
    "evaluation_due",
    "exceeds_combined_error_bars",
    "merged_regional_report",
    "minimum_detectable_shift",
    "propose_clip_bound",
    "update_bounds",
    "AggregatedMetric",
    "AggregatedVector",
    "BelowCohortFloor",
    "MetricSpec",
    "ParticipantBand",
    "RegionalReport",
    "SuppressedRegionBand",
    "SuppressedRelease",
    "aggregate_metric",
    "aggregate_sum",
    "aggregate_vector_sum",
    "count_band",
    "participant_band",
    "participant_band_lower_edge",
    "region_seed",
    "regional_report",
    "suppressed_region_band",
]

# --- envelope re-exports (owned by the envelope helper) -------------------
# Add `from clma.release.envelope import ...` lines here and extend __all__:
#   from clma.release.envelope import build_federated_metric_envelope  # noqa: E402
#   __all__ += ["build_federated_metric_envelope"]
from clma.release.envelope import (  # noqa: E402
    FEDERATED_METRIC_SCHEMA_VERSION,
    MAX_JSON_BYTES,
    MAX_JSON_INTEGER,
    FederatedMetricEnvelope,
    FederatedMetricError,
    FederatedMetricKind,
    FederatedParticipantCountBand,
    FederatedPrivacyMechanism,
    FederatedUncertaintyMethod,
    build_federated_metric_envelope,
    participant_count_band,
)

__all__ += [
    "FEDERATED_METRIC_SCHEMA_VERSION",
    "MAX_JSON_BYTES",
    "MAX_JSON_INTEGER",
    "FederatedMetricEnvelope",
    "FederatedMetricError",
    "FederatedMetricKind",
    "FederatedParticipantCountBand",
    "FederatedPrivacyMechanism",
    "FederatedUncertaintyMethod",
    "build_federated_metric_envelope",
    "participant_count_band",
]
# --- end envelope re-exports -----------------------------------------------
