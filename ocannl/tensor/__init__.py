"""The tensor DSL: build models as graphs of tensors; their code is generated from it.

By concept: ``leaves`` (``param``, ``term``, ``number``), ``pointwise`` (arithmetic, the
activations, comparisons, ``where``, ``gelu``, and ``cast``: the identity stored at another
precision), ``reductions`` (``sum``, ``max``, ``mean``, ``min``, ``reduce``, and ``matmul``: a
contraction is a sum of products), ``normalisations`` (``softmax``, ``log_softmax``,
``standardize``, ``global_standardize`` with its ``global_sums``), ``data`` (class ids,
``one_hot``, ``embedding``, ``Rng`` draws and ``dropout``, ``buffers``), ``einsum``,
``spatial`` (convolution, pooling); ``shape`` and ``tensor`` underneath. Every op builds its
forward assignments and, when differentiable, its backprop assignments, each next to the
other.
"""

from ocannl.tensor.concat import block, concat
from ocannl.tensor.data import (
    ClassIds,
    Rng,
    buffers,
    class_ids,
    dropout,
    embedding,
    one_hot,
    register_buffers,
    set_class_ids,
    uniform_expr,
)
from ocannl.tensor.einsum import Dims, assign, einsum
from ocannl.tensor.global_sums import GlobalSums, global_sums
from ocannl.tensor.leaves import (
    number,
    param,
    term,
)
from ocannl.tensor.normalisations import (
    global_standardize,
    log_softmax,
    softmax,
    standardize,
)
from ocannl.tensor.pointwise import (
    abs,
    add,
    cast,
    cos,
    div,
    eq,
    erf,
    exp,
    floor,
    ge,
    gelu,
    gt,
    le,
    log,
    lt,
    maximum,
    minimum,
    mul,
    ne,
    neg,
    pow_const,
    relu,
    sigmoid,
    sin,
    sqrt,
    sub,
    tanh,
    where,
)
from ocannl.tensor.reductions import (
    matmul,
    max,
    mean,
    min,
    reduce,
    sum,
)
from ocannl.tensor.shape import Shape
from ocannl.tensor.sharing import op
from ocannl.tensor.slicing import StaticIndex, batch_slice, rebatch, static_index
from ocannl.tensor.tensor import Init, Tensor, set_default_init, set_seed

__all__ = [
    "ClassIds", "Rng", "abs", "buffers", "class_ids", "dropout", "embedding", "eq", "erf", "ge",
    "gelu", "gt", "le", "log_softmax", "lt", "maximum", "min", "minimum", "ne", "one_hot",
    "reduce", "register_buffers", "set_class_ids", "softmax", "standardize", "uniform_expr",
    "where", "cos", "sin", "floor", "GlobalSums", "global_standardize", "global_sums",
    "Dims", "Init", "StaticIndex", "assign", "batch_slice", "block", "concat", "rebatch",
    "static_index", "Shape", "Tensor", "op", "set_default_init",
    "add", "cast", "div", "einsum", "exp", "log", "matmul", "max",
    "mean", "mul", "neg", "number", "param", "pow_const", "relu", "set_seed", "sigmoid", "sqrt",
    "sub", "sum", "tanh", "term",
]
