"""CLMA cohorting: signed KS direction test, Gram-trick PCA, clustering, cohort registry.

Source: CLMA (Adarsh N L, Amarlingam, Sharma, CODS-COMAD 2024, doi 10.1145/3703323.3703341),
Algorithm 3, with the improvements documented in :mod:`clma.cohort.cohorter` and
:mod:`clma.cohort.merging`.
"""

from clma.cohort.clustering import (
    AutoKMeans,
    Clusterer,
    ClusteringResult,
    OneCohortPerClient,
    canonical_labels,
)
from clma.cohort.cohorter import (
    DIRECTIONS,
    CLMACohorter,
    CohortAssignment,
    Cohorter,
    GroupDiagnostics,
    validate_client_stack,
)
from clma.cohort.ks import (
    KSComponents,
    SortedReference,
    ks_components,
    ks_components_from_sorted,
    ks_critical_value,
    signed_ks_from_sorted,
    signed_ks_statistic,
)
from clma.cohort.merging import (
    displacement_cosine_distances,
    merge_candidates,
    raw_cosine_distances,
)
from clma.cohort.projection import (
    GramPCAResult,
    gram_matrix,
    gram_pca,
    gram_pca_details,
    gram_pca_from_gram,
)
from clma.cohort.registry import (
    CohortRecord,
    CohortRegistry,
    CohortStatus,
    LineageEvent,
    RegistryError,
)

__all__ = [
    "DIRECTIONS",
    "AutoKMeans",
    "CLMACohorter",
    "Clusterer",
    "ClusteringResult",
    "CohortAssignment",
    "CohortRecord",
    "CohortRegistry",
    "CohortStatus",
    "Cohorter",
    "GramPCAResult",
    "GroupDiagnostics",
    "KSComponents",
    "LineageEvent",
    "OneCohortPerClient",
    "RegistryError",
    "SortedReference",
    "canonical_labels",
    "displacement_cosine_distances",
    "gram_matrix",
    "gram_pca",
    "gram_pca_details",
    "gram_pca_from_gram",
    "ks_components",
    "ks_components_from_sorted",
    "ks_critical_value",
    "merge_candidates",
    "raw_cosine_distances",
    "signed_ks_from_sorted",
    "signed_ks_statistic",
    "validate_client_stack",
]
