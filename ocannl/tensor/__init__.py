"""The tensor DSL: build models as graphs of tensors; their code is generated from it."""

from ocannl.tensor.operations import (
    add,
    cast,
    div,
    einsum,
    exp,
    log,
    matmul,
    max,
    mean,
    mul,
    neg,
    number,
    param,
    pow_const,
    relu,
    sigmoid,
    sqrt,
    sub,
    sum,
    tanh,
    term,
)
from ocannl.tensor.shape import Shape
from ocannl.tensor.tensor import Init, Tensor, set_seed

__all__ = [
    "Init", "Shape", "Tensor", "add", "cast", "div", "einsum", "exp", "log", "matmul", "max",
    "mean", "mul", "neg", "number", "param", "pow_const", "relu", "set_seed", "sigmoid", "sqrt",
    "sub", "sum", "tanh", "term",
]
