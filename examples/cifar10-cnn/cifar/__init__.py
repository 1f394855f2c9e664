"""The CIFAR-10 example's own code: the CNN factory (:mod:`cifar.model`) and the data
sources (:mod:`cifar.data`). Put this folder on ``PYTHONPATH`` (README)."""
