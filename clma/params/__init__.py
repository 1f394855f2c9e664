"""Parameter selection and flattening for CLMA (issue 3, items 1 and 6d-e).

Selectors (:class:`ParamSelector` extension point) choose which tensors form a client's
parameter vector; the flattening helpers build float32 ``(n_params,)`` vectors and
``(n_clients, n_params)`` stacks aligned by tensor name.
"""

from clma.params.errors import NonFiniteParameterError, ParameterAlignmentError, ParameterError
from clma.params.flatten import (
    flatten_state,
    model_to_vector,
    stack_client_vectors,
    state_shapes,
    unflatten_state,
    vector_to_model,
)
from clma.params.selectors import (
    TRACKED_BUFFER_SUFFIXES,
    AllParams,
    DefaultSelector,
    LastLayers,
    NameFilter,
    ParamSelector,
    TrainableOnly,
    is_floating,
    layer_of,
    requires_grad_selector,
)

__all__ = [
    "TRACKED_BUFFER_SUFFIXES",
    "AllParams",
    "DefaultSelector",
    "LastLayers",
    "NameFilter",
    "NonFiniteParameterError",
    "ParamSelector",
    "ParameterAlignmentError",
    "ParameterError",
    "TrainableOnly",
    "flatten_state",
    "is_floating",
    "layer_of",
    "model_to_vector",
    "requires_grad_selector",
    "stack_client_vectors",
    "state_shapes",
    "unflatten_state",
    "vector_to_model",
]
