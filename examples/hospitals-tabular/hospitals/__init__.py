"""The hospitals example's own code: the model factory (:mod:`hospitals.model`) and the
data sources (:mod:`hospitals.data`). Put this folder on ``PYTHONPATH`` (README)."""
