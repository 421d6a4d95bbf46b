"""Master weights: f32 parameters the optimizer updates and checkpoints save, read by the model
through reduced-precision cast twins whose gradients widen back into the masters'."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ocannl.ir.assignments import Accum, Get
from ocannl.ir.ops import Precision, precision_of
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor.tensor import Tensor, active_param_postprocess

__all__ = ["TWIN_PLACEMENTS", "cast_param", "master_of", "with_master_weights"]

R = TypeVar("R")

TWIN_PLACEMENTS = ("auto", "materialized", "virtual")
"""Where a cast twin lives. ``auto``: lowering decides: the twin is kept between steps
(``ocannl.ir.kept``), written in the pass that writes its master (the optimizer's update) and
recast by the context after the host writes the master; the host cannot read it;
``materialized``: a device buffer refreshed once per forward pass, readable from the host;
``virtual``: always recomputed at every read, never stored: a routine where that cannot be
(the master written between the cast and a read) is refused at compile, naming the twin."""

_TWIN_MODES = {"auto": MemoryMode.local, "materialized": MemoryMode.materialized,
               "virtual": MemoryMode.virtual}


def _check_placement(placement: str) -> None:
    if placement not in TWIN_PLACEMENTS:
        raise ValueError(f"placement {placement!r}: expected one of {TWIN_PLACEMENTS}")


def _link_twin(twin: Tensor, master: Tensor) -> None:
    """``twin = master`` rounded to the twin's precision; backprop ``master.grad += twin.grad``."""
    dims = twin.value.dims
    idx = tuple(range(len(dims)))
    twin.forward_code = (Accum(twin.value, idx, "=", Get(master.value, idx), dims),)
    assert master.grad is not None and twin.grad is not None
    twin.backprop_code = (Accum(master.grad, idx, "+", Get(twin.grad, idx), dims),)


def cast_param(p: Tensor, *, prec: Precision | str, placement: str = "auto") -> Tensor:
    """The reduced-precision cast twin of parameter ``p``, for the model to read instead of it.

    ``p`` stays the master: ``loss.params`` lists it (not the twin), so the optimizer updates it
    and checkpoints save it at full precision, while the twin is recomputed from it by every
    forward pass. The twin's gradient accumulates into ``p``'s gradient. A parameter whose dims
    are still to be inferred shares its open rows with its twin: the twin's uses infer both.
    A non-differentiable tensor is returned unchanged.
    """
    if not isinstance(p, Tensor):
        raise TypeError(f"cast_param expects a parameter Tensor, got {type(p).__name__}: {p!r}")
    prec = precision_of(prec)
    _check_placement(placement)
    if p.grad is None:
        return p
    if p.kind != "param":
        raise ValueError(f"cast_param: {p.label} is a {p.kind} tensor, not a parameter "
                         f"(a cast twin of a twin would have no master)")
    if p.prec.is_narrow:
        raise ValueError(f"cast_param: master {p.label} is {p.prec.value}; a master must be f32 "
                         f"or f64 (create the parameter at full precision)")
    node = Tnode(f"{p.label}_{prec.value}", p.value.dims_if_known, prec,
                 memory_mode=_TWIN_MODES[placement])
    # An open master's twin shares its rows: whatever the twin meets fixes the master's dims,
    # and the twin never has other dims than its master's.
    twin = Tensor(node, p.sym if p.sym is not None else p.shape, kind="op", children=(p,))
    twin.master = p
    if placement == "auto" and prec.is_narrow:  # kept between steps (``ocannl.ir.kept``)
        node.cast_of = p.value
        p.value.twins = (*p.value.twins, node)
    twin.defer(lambda: _link_twin(twin, p))
    return twin


def master_of(t: Tensor) -> Tensor:
    """The f32 master behind a cast twin (a tensor that is no twin is its own master)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"master_of expects a Tensor, got {type(t).__name__}: {t!r}")
    return t if t.master is None else t.master


def with_master_weights(*, prec: Precision | str, f: Callable[[], R],
                        placement: str = "auto") -> R:
    """Run the model-building function ``f`` so that every parameter it creates is handed out
    as a ``prec`` cast twin of an f32 master (:func:`cast_param`); returns ``f()``.

    Wrap the construction of the model (where ``ocannl.tensor.param`` is called), not only its
    application. Build the parameters at f32 (the default): the masters keep their precision.
    """
    prec = precision_of(prec)
    _check_placement(placement)
    if not callable(f):
        raise TypeError(f"with_master_weights: f must be callable, got {type(f).__name__}")
    outer = active_param_postprocess.get()

    def hook(p: Tensor) -> Tensor:
        return cast_param(outer(p), prec=prec, placement=placement)

    token = active_param_postprocess.set(hook)
    try:
        return f()
    finally:
        active_param_postprocess.reset(token)
