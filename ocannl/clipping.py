"""Gradient clipping with ``torch.nn.utils``' semantics, on the unscaled gradients, on the device.

Two kinds of clip, as torch's:

- :class:`ClipNorm` (``clip_grad_norm_``): ``total_norm`` is the 2-norm (or the inf-norm) of all
  the parameters' gradients taken together; every gradient is multiplied by
  ``min(1, max_norm / (total_norm + 1e-6))``.
- :class:`ClipValue` (``clip_grad_value_``): every gradient element is clamped to
  ``[-clip_value, clip_value]``.

Under loss scaling the clip sees what the optimizer would apply, the gradients times the
scaler's reciprocal (torch: ``scaler.unscale_(optimizer)`` before the clip). A clip is a spec;
:func:`clipper` binds it to one loss as a :class:`GradClipper`, which holds the computation of
the norm (run after the gradients, and after a data-parallel reducer) and rewrites each
gradient the optimizer reads (``Optimizer.update(loss, clip=...)``). The norm is a one-element
f32 device tensor: nothing is read back unless the host asks (``ctx.get_value(c.norm)``).

The sum of squares is accumulated in f32 over the f32 (master) gradients. Squares that
overflow f32 (a norm above about 1.8e19) make the norm infinite even when every gradient is
finite; a non-finite norm skips the step, as non-finite gradients do: the update is gated on
it (or, in the recipes of :mod:`ocannl.mixed_prec`, the norm is folded into the checksum that
gates the step), so a skipped step clips nothing and changes nothing.

For training without a recipe, :func:`clipped_update` returns the norm's computation followed
by the clipped optimizer update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ocannl.errors import f32_positive, is_real
from ocannl.ir.assignments import Accum, Comp, Const, Expr, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.optim import Optimizer, Scalar, UpdateClip, scalar_expr
from ocannl.tensor.shape import Shape
from ocannl.tensor.tensor import Tensor, copy_into

__all__ = ["NORM_EPS", "NORM_TYPES", "Clip", "ClipNorm", "ClipValue", "GradClipper",
           "check_clip", "clipped_update", "clipper"]

NORM_TYPES = (2.0, math.inf)
"""The norms :class:`ClipNorm` computes: the 2-norm and the max-norm (``float('inf')``)."""

NORM_EPS = 1e-6
"""Added to the norm before the division, as torch's ``clip_grad_norm_``."""

# A gradient whose last axis has at least this many cells is summed a row at a time (vector
# registers), as train.grad_checksum does.
_ROW = 8


@dataclass(frozen=True)
class ClipNorm:
    """Clip by the global norm (``torch.nn.utils.clip_grad_norm_``): ``max_norm`` a finite
    number > 0 that stays one in f32 (1e-50 is 0 in the f32 code: no step would move a
    parameter), ``norm_type`` 2 or ``float('inf')``; NumPy scalars are numbers, bools not."""

    max_norm: float
    norm_type: float = 2.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_norm", f32_positive("ClipNorm: max_norm", self.max_norm))
        t = self.norm_type
        try:
            v = float(t) if is_real(t) else None
        except OverflowError:
            v = None
        if v not in NORM_TYPES:
            raise ValueError(f"ClipNorm: norm_type must be 2 or float('inf'), got "
                             f"{type(t).__name__}: {t!r:.60}")
        object.__setattr__(self, "norm_type", v)


@dataclass(frozen=True)
class ClipValue:
    """Clamp each gradient element to ``[-clip_value, clip_value]``
    (``torch.nn.utils.clip_grad_value_``); ``clip_value`` a finite number > 0 that stays one
    in f32, as :class:`ClipNorm`'s ``max_norm``."""

    clip_value: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_value",
                           f32_positive("ClipValue: clip_value", self.clip_value))


Clip = ClipNorm | ClipValue


def check_clip(clip: object) -> Clip:
    """``clip`` if it is a :class:`ClipNorm` or :class:`ClipValue`, else ``TypeError``."""
    if not isinstance(clip, (ClipNorm, ClipValue)):
        raise TypeError(f"clip must be a clipping.ClipNorm or clipping.ClipValue, got "
                        f"{type(clip).__name__}: {clip!r:.80}")
    return clip


def _same_scalar(a: Scalar | None, b: Scalar | None) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    return a == b


class GradClipper(UpdateClip):
    """A clip bound to the gradients of one loss (build it with :func:`clipper`).

    ``norm`` and ``coef`` (clip by norm only, else ``None``) are one-element f32 tensors that
    :attr:`comp` computes: the total norm of the unscaled gradients and the factor
    ``min(1, max_norm / (norm + 1e-6))`` the optimizer multiplies them by. :meth:`apply` is that
    rewrite of one unscaled gradient; :meth:`gate` folds the norm's finiteness into an update's
    gate (``gate_on_norm=False``: a caller whose own gate already covers the norm).
    """

    def __init__(self, clip: Clip, loss: Tensor, *, unscale: Scalar | None = None,
                 gate_on_norm: bool = True) -> None:
        self.clip = check_clip(clip)
        if not isinstance(loss, Tensor):
            raise TypeError(f"clipper expects the loss Tensor, got {type(loss).__name__}")
        if loss.grad is None:
            raise ValueError(f"loss {loss.label} depends on no parameter: nothing to clip")
        if type(gate_on_norm) is not bool:
            raise ValueError(f"gate_on_norm must be a bool, got {gate_on_norm!r}")
        self.loss = loss
        self.unscale = unscale
        self.gate_on_norm = gate_on_norm
        self.norm: Tensor | None = None
        self.coef: Tensor | None = None
        self.comp = Comp(label=f"clip_{loss.label}")
        if isinstance(clip, ClipNorm):
            self._build_norm(clip)

    def _scalar(self, name: str) -> Tensor:
        return Tensor(Tnode(f"{name}_{self.loss.label}", (), Precision.f32), Shape(), kind="op",
                      differentiable=False)

    def _build_norm(self, clip: ClipNorm) -> None:
        u = None if self.unscale is None else scalar_expr(self.unscale, "unscale")
        two = clip.norm_type == 2.0
        # 2-norm: the sum of squares, then its root; inf-norm: the running maximum of |g|,
        # which keeps a NaN once it has seen one (the op's NaN rule), as the sum does.
        acc = self._scalar("grad_sumsq" if two else "grad_absmax")
        code = [copy_into(acc.value, Const(0.0))]
        op = "+" if two else "max"
        for p in self.loss.params:
            assert p.grad is not None
            axes = tuple(range(len(p.dims)))
            g: Expr = Get(p.grad, axes)
            if u is not None:
                g = apply("mul", g, u)
            term = apply("mul", g, g) if two else apply("abs", g)
            if len(p.dims) >= 2 and p.dims[-1] >= _ROW:
                row = Tnode(f"clip_rows_{p.label}", (p.dims[-1],), Precision.f32)
                code.append(Accum(row, (axes[-1],), op, term, p.dims, reset=True))
                code.append(Accum(acc.value, (), op, Get(row, (0,)), (p.dims[-1],)))
            else:
                code.append(Accum(acc.value, (), op, term, p.dims))
        norm = self._scalar("grad_norm")
        total = Get(acc.value, ())
        code.append(copy_into(norm.value, apply("sqrt", total) if two else total))
        coef = self._scalar("clip_coef")
        ratio = apply("div", Const(clip.max_norm), apply("add", Get(norm.value, ()),
                                                         Const(NORM_EPS)))
        code.append(Accum(coef.value, (), "=", apply("min", ratio, Const(1.0)), ()))
        self.norm, self.coef = norm, coef
        self.comp = Comp(tuple(code), f"clip_{self.loss.label}")

    def finite(self) -> Expr | None:
        """1 where the norm is finite, 0 where not (``None``: a clip by value has no norm)."""
        return None if self.norm is None else apply("isfinite", Get(self.norm.value, ()))

    def gate(self, gate: Expr | None) -> Expr | None:
        """``gate`` and the norm's finiteness (both 0/1, so their product is their and)."""
        finite = self.finite() if self.gate_on_norm else None
        if finite is None:
            return gate
        return finite if gate is None else apply("mul", gate, finite)

    def apply(self, g: Expr) -> Expr:
        """The clipped form of one unscaled gradient element ``g``."""
        if self.coef is not None:
            return apply("mul", g, Get(self.coef.value, ()))
        assert isinstance(self.clip, ClipValue)
        v = self.clip.clip_value
        return apply("min", apply("max", g, Const(-v)), Const(v))

    def check_for(self, loss: Tensor, grad_unscale: Scalar | None) -> None:
        """``ValueError`` unless this clipper was built for ``loss`` and ``grad_unscale``."""
        if loss is not self.loss:
            raise ValueError(f"this clipper was built for loss {self.loss.label}, not "
                             f"{loss.label}: build one with clipping.clipper(clip, loss)")
        if not _same_scalar(self.unscale, grad_unscale):
            raise ValueError(f"this clipper was built with unscale={self.unscale!r:.60}, the "
                             f"update has grad_unscale={grad_unscale!r:.60}: the norm must be "
                             f"of the gradients the optimizer applies")

    def __repr__(self) -> str:
        return f"GradClipper({self.clip!r}, loss={self.loss.label})"


def clipper(clip: Clip, loss: Tensor, *, unscale: Scalar | None = None,
            gate_on_norm: bool = True) -> GradClipper:
    """Bind ``clip`` to ``loss``'s gradients times ``unscale`` (see :class:`GradClipper`)."""
    return GradClipper(clip, loss, unscale=unscale, gate_on_norm=gate_on_norm)


def clipped_update(optimizer: Optimizer, loss: Tensor, clip: Clip, *,
                   grad_unscale: Scalar | None = None,
                   gate: Expr | None = None) -> tuple[Comp, GradClipper]:
    """The clip's norm computation followed by ``optimizer``'s update of the clipped gradients
    (run it after ``train.grad_update(loss)``), and the clipper (its ``norm`` for logging).

    The update is gated on the norm being finite: a step with non-finite gradients (or an
    overflowing norm) is skipped, every parameter and optimizer buffer keeping its bits,
    instead of writing NaN into the weights.
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"expected an ocannl.optim optimizer, got {type(optimizer).__name__}")
    c = clipper(clip, loss, unscale=grad_unscale)
    update = optimizer.update(loss, grad_unscale=grad_unscale, gate=gate, clip=c)
    return Comp.seq([c.comp, update], f"clipped_{update.label}"), c
