"""Data of a federation, below the simulation and the devices: the built-in data sets
(:mod:`clma.datasets.builtin`), the user's own source (:mod:`clma.datasets.source`,
``[data] source``) and the partition of samples among clients
(:mod:`clma.datasets.partition`)."""

from clma.datasets.builtin import (
    Dataset,
    DatasetError,
    holdout_split,
    load_cifar10,
    load_dataset,
    load_digits,
    load_fashion_mnist,
)
from clma.datasets.partition import dirichlet_partition, iid_partition
from clma.datasets.source import load_source

__all__ = [
    "Dataset",
    "DatasetError",
    "dirichlet_partition",
    "holdout_split",
    "iid_partition",
    "load_cifar10",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_source",
]
