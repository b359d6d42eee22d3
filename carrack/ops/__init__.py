"""Kernels, one module per operator family; importing this package registers them all.

Each module keeps an operator's attribute parsing and numpy kernel side by side in one small class,
registered with ``@register(op_type, since=version, domain=...)``; see `carrack.ops.registry`.
"""

from carrack.ops import (  # noqa: F401
    activations,
    attention,
    blocked,
    cast,
    contrib,
    contrib_quant,
    contrib_transformer,
    control_flow,
    conv,
    detection,
    elementwise,
    fused,
    gguf_ops,
    gradient,
    image,
    indexing,
    linalg,
    losses,
    ml,
    normalization,
    pool,
    quant,
    random,
    reduce,
    resize,
    rnn,
    sequence,
    shape_ops,
    signal,
    text,
    training,
)
from carrack.ops.registry import Kernel, register

__all__ = ["Kernel", "register"]
