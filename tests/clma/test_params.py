"""Parameter selectors and name-aligned flattening (issue 3, items 1, 6d, 6e)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from clma.params import (
    AllParams,
    DefaultSelector,
    LastLayers,
    NameFilter,
    NonFiniteParameterError,
    ParameterAlignmentError,
    ParamSelector,
    TrainableOnly,
    flatten_state,
    model_to_vector,
    requires_grad_selector,
    stack_client_vectors,
    unflatten_state,
    vector_to_model,
)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 3),      # 0.weight (3,4), 0.bias (3,)
        nn.BatchNorm1d(3),    # 1.weight, 1.bias, running_mean, running_var, num_batches_tracked
        nn.ReLU(),
        nn.Linear(3, 2),      # 3.weight (2,3), 3.bias (2,)
    )


PARAM_NAMES = ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]


def test_selectors_are_param_selectors() -> None:
    net = make_net()
    for sel in (DefaultSelector(), AllParams(), LastLayers(1), NameFilter(),
                requires_grad_selector(net)):
        assert isinstance(sel, ParamSelector)


def test_default_selector_excludes_buffers_module_and_mapping() -> None:
    net = make_net()
    assert DefaultSelector().select_module(net) == PARAM_NAMES
    # On a plain state dict the same names come out (buffers recognised by name/dtype).
    assert DefaultSelector().select(net.state_dict()) == PARAM_NAMES
    numpy_state = {k: v.numpy() for k, v in net.state_dict().items()}
    assert DefaultSelector().select(numpy_state) == PARAM_NAMES


def test_all_params_includes_floating_buffers() -> None:
    net = make_net()
    names = AllParams().select_module(net)
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                     "1.running_var", "3.weight", "3.bias"]
    assert "1.num_batches_tracked" not in names  # integer counter


def test_last_layers() -> None:
    net = make_net()
    assert LastLayers(1).select_module(net) == ["3.weight", "3.bias"]
    assert LastLayers(2).select_module(net) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert LastLayers(10).select_module(net) == PARAM_NAMES
    with pytest.raises(ValueError, match="n:"):
        LastLayers(0)


def test_name_filter_patterns() -> None:
    net = make_net()
    assert NameFilter(include=("*.weight",)).select_module(net) == [
        "0.weight", "1.weight", "3.weight"]
    assert NameFilter(exclude=("*.bias", "1.*")).select_module(net) == ["0.weight", "3.weight"]
    assert NameFilter(include=("1.*",), include_buffers=True).select_module(net) == [
        "1.weight", "1.bias", "1.running_mean", "1.running_var"]
    with pytest.raises(TypeError):
        NameFilter(include="*.weight")  # type: ignore[arg-type]


def test_trainable_only_follows_requires_grad() -> None:
    net = make_net()
    for p in net[0].parameters():
        p.requires_grad_(False)  # frozen backbone
    sel = requires_grad_selector(net)
    assert isinstance(sel, TrainableOnly)
    assert sel.select_module(net) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert sel.select(net.state_dict()) == ["1.weight", "1.bias", "3.weight", "3.bias"]
    net[0].weight.requires_grad_(True)
    assert sel.select_module(net)[0] == "0.weight"


def test_flatten_roundtrip_and_dtype() -> None:
    net = make_net()
    vec = model_to_vector(net)
    assert vec.dtype == np.float32 and vec.shape == (12 + 3 + 3 + 3 + 6 + 2,)
    expected = np.concatenate([net.state_dict()[n].numpy().ravel() for n in PARAM_NAMES])
    np.testing.assert_array_equal(vec, expected)
    parts = unflatten_state(vec, {n: net.state_dict()[n] for n in PARAM_NAMES})
    for n in PARAM_NAMES:
        np.testing.assert_array_equal(parts[n], net.state_dict()[n].numpy())
    other = make_net()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    vector_to_model(vec, other)
    np.testing.assert_array_equal(model_to_vector(other), vec)
    # Buffers untouched by the default selector.
    assert torch.equal(other.state_dict()["1.running_var"], torch.ones(3))


def test_flatten_state_float64_input_written_as_float32() -> None:
    state = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.array([0.5])}
    vec = flatten_state(state, ["b", "a"])
    assert vec.dtype == np.float32
    np.testing.assert_array_equal(vec, np.array([0.5, 0, 1, 2, 3, 4, 5], dtype=np.float32))
    with pytest.raises(ParameterAlignmentError, match="'c'"):
        flatten_state(state, ["a", "c"])
    with pytest.raises(ParameterAlignmentError, match="vector"):
        unflatten_state(vec[:-1], {"b": (1,), "a": (2, 3)})


def test_vector_to_model_rejects_bad_vectors() -> None:
    net = make_net()
    vec = model_to_vector(net)
    with pytest.raises(ParameterAlignmentError):
        vector_to_model(vec[:-1], net)
    bad = vec.copy()
    bad[3] = np.nan
    with pytest.raises(NonFiniteParameterError):
        vector_to_model(bad, net)


def _states(rng: np.random.Generator, n: int) -> dict[str, dict[str, np.ndarray]]:
    return {f"client-{i}": {"w": rng.normal(size=(2, 3)).astype(np.float32),
                            "b": rng.normal(size=(3,)).astype(np.float32)} for i in range(n)}


def test_stack_aligns_by_name_not_order() -> None:
    rng = np.random.default_rng(1)
    states = _states(rng, 3)
    # Client 1 sends its tensors in the opposite order: must be aligned by name.
    states["client-1"] = {"b": states["client-1"]["b"], "w": states["client-1"]["w"]}
    stack = stack_client_vectors(states, ["w", "b"])
    assert stack.dtype == np.float32 and stack.shape == (3, 9)
    for i, (_cid, st) in enumerate(states.items()):
        np.testing.assert_array_equal(stack[i], np.concatenate([st["w"].ravel(), st["b"]]))


def test_stack_accepts_torch_tensors() -> None:
    rng = np.random.default_rng(2)
    states = {c: {k: torch.from_numpy(v) for k, v in s.items()}
              for c, s in _states(rng, 2).items()}
    stack = stack_client_vectors(states, ["w", "b"])
    np.testing.assert_array_equal(stack[1, :6], states["client-1"]["w"].numpy().ravel())


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.pop("b"), r"client 'client-2': missing tensors \['b'\]"),
    (lambda s: s.__setitem__("extra", np.zeros(1, np.float32)),
     r"client 'client-2': unexpected tensors \['extra'\]"),
    (lambda s: s.__setitem__("b", np.zeros(4, np.float32)),
     r"client 'client-2': tensor 'b' has shape \(4,\), expected \(3,\)"),
    (lambda s: s.__setitem__("w", np.zeros((3, 2), np.float32)),
     r"client 'client-2': tensor 'w' has shape \(3, 2\)"),
])
def test_stack_rejects_misaligned_clients(mutate, match) -> None:
    rng = np.random.default_rng(3)
    states = _states(rng, 3)
    mutate(states["client-2"])
    with pytest.raises(ParameterAlignmentError, match=match):
        stack_client_vectors(states, ["w", "b"])


def test_stack_renamed_tensor_rejected() -> None:
    rng = np.random.default_rng(4)
    states = _states(rng, 2)
    states["client-1"]["bias"] = states["client-1"].pop("b")
    with pytest.raises(ParameterAlignmentError, match="client 'client-1': missing"):
        stack_client_vectors(states, ["w", "b"])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_stack_rejects_non_finite_naming_client_not_value(bad: float) -> None:
    rng = np.random.default_rng(5)
    states = _states(rng, 3)
    states["client-1"]["w"][1, 2] = bad
    with pytest.raises(NonFiniteParameterError, match="client 'client-1': tensor 'w'") as ei:
        stack_client_vectors(states, ["w", "b"])
    assert str(ei.value) == "client 'client-1': tensor 'w' contains NaN or inf"


def test_stack_allow_extra_and_explicit_shapes() -> None:
    rng = np.random.default_rng(6)
    states = _states(rng, 2)
    states["client-0"]["running_mean"] = np.zeros(3, np.float32)
    stack = stack_client_vectors(states, ["b"], allow_extra=True)
    assert stack.shape == (2, 3)
    with pytest.raises(ParameterAlignmentError, match="client 'client-0'"):
        stack_client_vectors(states, ["w"], shapes={"w": (3, 2)}, allow_extra=True)
