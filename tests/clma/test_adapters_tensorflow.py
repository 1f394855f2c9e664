"""clma.adapters.tensorflow on a Keras 3 model (backend: KERAS_BACKEND, default here torch,
which this environment has; TensorFlow itself is the optional extra ``tensorflow-cpu``):
fed-clma 0.1.1's keys (checked against fed-clma's own adapter), exact round trips, and the
selectors -- DefaultSelector, AllParams, LastLayers, trainable_selector, head_selector --
on those keys, as far as the Flower layout the strategy cohorts on."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # read when keras is first imported
os.environ.setdefault("KERAS_HOME", tempfile.mkdtemp(prefix="clma-keras-home-"))
keras = pytest.importorskip("keras", reason="keras is in the 'tensorflow' and 'dev' extras")

from clma.adapters import tensorflow as tfa  # noqa: E402
from clma.params import AllParams, DefaultSelector, LastLayers  # noqa: E402

# keras' torch backend calls np.array(tensor, copy=False) internally (numpy 2 warns)
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")

KEYS = ["0000:kernel", "0001:bias", "0002:gamma", "0003:beta", "0004:moving_mean",
        "0005:moving_variance", "0006:kernel", "0007:bias"]


def _model(seed: int = 0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                             keras.layers.BatchNormalization(), keras.layers.Dropout(0.1),
                             keras.layers.Dense(3)])


def _fedclma_tensorflow():
    from tests.flower import fedclma_ref

    fedclma_ref.load()
    import importlib

    return importlib.import_module("fedclma_ref.adapters.tensorflow")


def test_keys_are_fedclmas_and_do_not_depend_on_keras_layer_counters():
    a, b = _model(0), _model(1)  # built twice: layer names dense / dense_2 ... differ
    assert [v.path for v in a.weights] != [v.path for v in b.weights]
    assert tfa.variable_names(a) == tfa.variable_names(b) == KEYS
    theirs = _fedclma_tensorflow().get_weights(a)
    ours = tfa.get_weights(a)
    assert list(ours) == list(theirs) == KEYS
    for k in KEYS:
        np.testing.assert_array_equal(ours[k], theirs[k])
        assert ours[k].dtype == np.float32


def test_set_weights_round_trips_in_any_order_and_refuses_other_keys():
    m = _model()
    rng = np.random.default_rng(3)
    new = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in tfa.get_weights(m).items()}
    new["0005:moving_variance"] = np.abs(new["0005:moving_variance"]) + 0.5  # a variance
    tfa.set_weights(m, dict(reversed(list(new.items()))))
    got = tfa.get_weights(m)
    for k in KEYS:
        np.testing.assert_array_equal(got[k], new[k])
    out = m.predict(np.ones((2, 4), np.float32), verbose=0)
    assert out.shape == (2, 3) and np.all(np.isfinite(out))
    before = tfa.get_weights(m)
    with pytest.raises(ValueError, match="missing '0007:bias'"):
        tfa.set_weights(m, {k: v for k, v in new.items() if k != "0007:bias"})
    with pytest.raises(ValueError, match="unexpected 'dense/kernel'"):
        tfa.set_weights(m, {**new, "dense/kernel": new["0000:kernel"]})
    with pytest.raises(ValueError, match=r"params\['0006:kernel'\]: shape \(3, 8\)"):
        tfa.set_weights(m, {**new, "0006:kernel": new["0006:kernel"].T})
    for k, v in tfa.get_weights(m).items():  # nothing half-written
        np.testing.assert_array_equal(v, before[k])


def test_default_and_all_params_on_keras_keys_match_fedclma():
    ref = _fedclma_tensorflow()
    from fedclma_ref.params import AllParams as TheirAll
    from fedclma_ref.params import DefaultSelector as TheirDefault

    named = tfa.get_weights(_model())
    learnable = ["0000:kernel", "0001:bias", "0002:gamma", "0003:beta", "0006:kernel",
                 "0007:bias"]
    assert DefaultSelector().select(named) == TheirDefault().select(named) == learnable
    assert AllParams().select(named) == TheirAll().select(named) == KEYS
    assert ref is not None


def test_last_layers_counts_tensors_on_keras_keys_head_selector_counts_layers():
    m = _model()
    named = tfa.get_weights(m)
    _fedclma_tensorflow()  # loads the vendored fed-clma (not an import side effect of order)
    from fedclma_ref.params import LastLayers as TheirLast

    assert LastLayers(2).select(named) == TheirLast(2).select(named) == ["0006:kernel",
                                                                         "0007:bias"]
    assert tfa.head_selector(m, 1).select(named) == ["0006:kernel", "0007:bias"]
    # two layers: BatchNormalization's gamma/beta (statistics excluded) and the head
    assert tfa.head_selector(m, 2).select(named) == ["0002:gamma", "0003:beta",
                                                     "0006:kernel", "0007:bias"]
    with pytest.raises(ValueError, match="n_layers: must be an integer >= 1"):
        tfa.head_selector(m, 0)


def test_trainable_selector_reads_the_model_live():
    m = _model()
    named = tfa.get_weights(m)
    sel = tfa.trainable_selector(m)
    assert sel.select(named) == DefaultSelector().select(named)
    m.layers[0].trainable = False  # freeze the first Dense after the selector was made
    assert sel.select(named) == ["0002:gamma", "0003:beta", "0006:kernel", "0007:bias"]
    m.layers[0].trainable = True
    assert "0000:kernel" in sel.select(named)
    m.trainable = False
    with pytest.raises(ValueError, match="model: has no trainable weights"):
        tfa.trainable_selector(m)


def test_keras_selectors_reach_the_strategys_layout():
    pytest.importorskip("flwr", reason="the strategy side needs the flower extra (a keras-only install has no flwr)")
    from clma.flower.arrays import ArrayLayout
    from clma.interop import to_arrayrecord, to_paramdict

    m = _model()
    record = to_arrayrecord(tfa.get_weights(m))
    assert list(to_paramdict(record)) == KEYS
    layout = ArrayLayout.of(record)
    assert layout.n_params == 4 * 8 + 8 + 4 * 8 + 8 * 3 + 3
    idx = layout.selector_indices(tfa.head_selector(m, 1))
    head = np.concatenate([tfa.get_weights(m)["0006:kernel"].ravel(),
                           tfa.get_weights(m)["0007:bias"]])
    np.testing.assert_array_equal(layout.to_vector(record)[idx], head)
    # the default vector for cohorting leaves out the moving statistics (16 values)
    assert layout.selector_indices(DefaultSelector()).shape == (layout.n_params - 16,)
