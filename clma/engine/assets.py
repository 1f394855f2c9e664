"""The server's public assets for a federation on real clients, built from the config alone.

A deployment's server holds no device data, so it cannot build the simulated federation
(:func:`clma.sim.federation.build_federation`) to find its architecture and probe set.
:func:`deployment_assets` builds the same :class:`~clma.engine.state.ServerAssets` from
what the server may hold:

* ``[model] factory`` set -- the user's model: the factory's initialisation at the
  federation's seed (:meth:`clma.models.FactoryModelSpec.build`), or ``[model] weights``;
  the probe set from the ``[data] probe`` file (required: the server holds no samples), and
  the start-up check of :func:`clma.models.checks.check_model_on_features` on it.
* no factory -- the built-in MLP shaped by the reference data set ``[data] dataset``
  (public data on the server: scikit-learn's digits, or the files of ``data_dir``), its
  probe from that data set's held-out split (or the probe file): exactly the assets of the
  simulation of the same config, so a deployment and a simulation start from the same
  model.

The region partition is ``[data] region_partition`` (the bundled one by default).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from clma.engine.state import ServerAssets

__all__ = ["DEVICE_DATA_NAME", "deployment_assets"]

#: ``ServerAssets.dataset_name`` of a federation whose devices bring their own data.
DEVICE_DATA_NAME = "device data (node config data-source)"


def deployment_assets(config: Any) -> ServerAssets:
    """The server's assets of ``config`` (module docstring); imports no simulation.

    Args:
        config: a validated :class:`clma.config.FederationConfig`.

    Returns:
        ServerAssets: ``initial_model`` float32 ``(n_params,)`` in ``AllParams`` order,
        ``probe_x`` float32 ``(P, ...)``.

    Raises:
        ValueError: naming the field: ``model.factory`` (does not import, raises, returns
            no module, rejects the probe set), ``model.weights`` (unreadable, keys or
            shapes), ``data.probe`` (missing with a factory, unreadable, wrong shape);
        clma.datasets.DatasetError: ``data.data_dir``: the reference data set is missing;
        clma.regions.PartitionError: ``data.region_partition``.
    """
    from clma.datasets import holdout_split
    from clma.models.checks import check_model_on_features, load_probe, spec_and_reference_data
    from clma.models.factory import load_weights
    from clma.params import AllParams, model_to_vector
    from clma.regions import PartitionError, load_partition

    try:
        partition = load_partition(config.data.region_partition)
    except PartitionError as exc:
        raise PartitionError(f"data.region_partition: {exc}") from None
    spec, dataset = spec_and_reference_data(config)
    if dataset is None:
        if not config.data.probe:
            raise ValueError("data.probe: a federation of real clients with model.factory "
                             "needs a probe file (the server holds none of the devices' "
                             "data)")
        probe_x = load_probe(config.data.probe)
        n_classes, name = None, DEVICE_DATA_NAME
    else:
        if config.data.probe:
            probe_x = load_probe(config.data.probe, dataset.images.shape[1:])
        else:
            split = holdout_split(dataset.labels, holdout_fraction=config.data.holdout_fraction,
                                  probe_size=config.data.probe_size, seed=config.seed)
            probe_x = dataset.images[split.probe]
        n_classes, name = dataset.n_classes, dataset.name
    model = spec.build(seed=config.seed)
    if config.model.weights:
        load_weights(model, config.model.weights)
    if config.model.factory:
        check_model_on_features(model, probe_x, n_classes,
                                needs_relu=config.divergence.enabled)
    initial = model_to_vector(model, AllParams())
    return ServerAssets(model_spec=spec, initial_model=np.asarray(initial, np.float32),
                        probe_x=np.ascontiguousarray(probe_x), partition=partition,
                        dataset_name=name)

