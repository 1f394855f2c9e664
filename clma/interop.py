"""fed-clma 0.1.1's record keys and Flower record conversions (``clma.interop``; imports
flwr): the one place these wire names are defined (:mod:`clma.client`,
:mod:`clma.flower.fedclma`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

__all__ = ["COHORT_KEY", "DRIFT_KEY", "LOSS_KEY", "NUM_EXAMPLES_KEY", "to_arrayrecord",
           "to_paramdict"]

#: Metric key of a train reply's drift flag (0/1: MetricRecord has no bool).
DRIFT_KEY = "clma-drift"
#: Metric key of a train reply's local loss (diagnostics).
LOSS_KEY = "clma-loss"
#: Config key of a train message naming the client's cohort.
COHORT_KEY = "clma-cohort"
#: Metric key of a train reply's example count (the FedAvg weight).
NUM_EXAMPLES_KEY = "num-examples"


def to_paramdict(record: ArrayRecord) -> dict[str, np.ndarray]:
    """An ``ArrayRecord`` as key -> numpy array (record order)."""
    return {k: record[k].numpy() for k in record.keys()}


def to_arrayrecord(params: Mapping[str, np.ndarray]) -> ArrayRecord:
    """key -> numpy array (e.g. :func:`clma.adapters.tensorflow.get_weights`) as an
    ``ArrayRecord`` (mapping order)."""
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in params.items()})
