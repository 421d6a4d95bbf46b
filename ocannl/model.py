"""A model built more than once over one set of parameters, and its evaluation routine.

A training graph's batch size is fixed when it is built (its routines are compiled for its
input's dims). To evaluate on another batch size, or in evaluation mode, build the model again
over another input: :class:`Model` runs the model-building function once per input, the first
build creating the parameters (and state buffers: batch-norm running statistics) and every
later build getting the same tensors back (``ocannl.tensor.sharing``), so both graphs read the
same parameter buffers of a context. :func:`compile_eval` compiles the forward code of such an
evaluation graph: no gradient buffers, and a refusal of any graph that would write training
state (a train-mode batch norm updating its statistics, a dropout advancing its random stream,
a parameter).

    model = Model(lambda x, train: nn_blocks.lenet(x, num_classes=10)[0])
    logits = model(x_train, train=True)        # the training graph, batch 64
    ...compile the training step...
    ctx, ev = compile_eval(ctx, model(x_test, train=False))   # batch 360, the same weights
    ctx, (test_logits,) = ev.run(ctx, {x_test: images})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from ocannl.context import Context, Routine, _as_node
from ocannl.errors import require_bool
from ocannl.ir.assignments import Comp
from ocannl.ir.lowering import effects
from ocannl.tensor.sharing import ParamScope, active_scope
from ocannl.tensor.tensor import Tensor

__all__ = ["Evaluation", "Model", "compile_eval"]

R = TypeVar("R")


class Model(Generic[R]):
    """``build(*inputs, train=...)`` applied to several inputs over one set of parameters.

    The first call records every parameter ``build`` creates (by label: labels must be
    distinct, as checkpoints need them anyway) and every state buffer; each later call hands
    the same tensors back, checking that each is asked for with the same shape, precision and
    init, and refusing one the first build did not create (``ValueError`` naming it). Build the
    training graph first: a parameter whose input axes are inferred gets them there.
    ``build`` may wrap itself in ``mixed_prec.with_master_weights``: the masters are shared,
    each graph gets its own cast twins of them."""

    def __init__(self, build: Callable[..., R], *, name: str | None = None) -> None:
        if not callable(build):
            raise TypeError(f"Model: build must be callable, got {type(build).__name__}")
        self.build = build
        self.name = name or f"Model({getattr(build, '__name__', 'build')})"
        self.scope = ParamScope(self.name)
        self.builds = 0

    def __call__(self, *inputs: Any, train: bool, **kwargs: Any) -> R:
        """``build(*inputs, train=train, **kwargs)`` over this model's parameters."""
        train = require_bool(f"{self.name}: train", train)
        if self.builds:
            self.scope.begin_reuse()
        token = active_scope.set(self.scope)
        try:
            out = self.build(*inputs, train=train, **kwargs)
        except BaseException:
            if not self.builds:  # a failed first build records nothing
                self.scope = ParamScope(self.name)
            raise
        finally:
            active_scope.reset(token)
        self.builds += 1
        return out

    @property
    def params(self) -> list[Tensor]:
        """The parameters the first build created (the f32 masters under mixed precision), in
        creation order."""
        return list(self.scope.params.values())

    @property
    def state_buffers(self) -> list[Tensor]:
        """The state buffers (batch-norm running statistics) the first build created."""
        return list(self.scope.states.values())

    def __repr__(self) -> str:
        return f"{self.name}: {len(self.scope.params)} parameters, {self.builds} builds"


class Evaluation:
    """A compiled evaluation routine: the forward code of ``outputs``, bound to a context.

    :meth:`run` writes the given inputs (``set_values``), runs the routine and returns each
    output's values; ``routine`` is the plain routine for a loop of its own."""

    def __init__(self, routine: Routine, outputs: tuple[Tensor, ...]) -> None:
        self.routine = routine
        self.outputs = outputs
        self._reads = {n.id for n in routine.inputs}

    def run(self, ctx: Context, inputs: Mapping[Tensor, Any] | None = None
            ) -> tuple[Context, list[np.ndarray]]:
        """Write ``inputs`` (tensor -> values), run, return the outputs' values. An input the
        graph does not read is refused, naming it and what the graph reads, before anything
        is written: the training input given by mistake would be overwritten, and the outputs
        computed from whatever the graph's own input held."""
        inputs = inputs or {}
        unread = [(t, n) for t in inputs if (n := _as_node(t)).id not in self._reads]
        if unread:
            params = {p.value.id for o in self.outputs for p in o.params}
            reads = [n.name for n in self.routine.inputs if n.id not in params]
            names = ", ".join(f"{getattr(t, 'label', n.label)} (node {n.name})"
                              for t, n in unread)
            raise ValueError(f"{self!r}.run: the graph does not read {names}: it reads "
                             f"{', '.join(reads) or 'no input'}, and {len(params)} "
                             f"parameters; nothing was written")
        for t, values in inputs.items():
            ctx = ctx.set_values(t, values)
        ctx = ctx.run(self.routine)
        return ctx, [ctx.get_values(t) for t in self.outputs]

    def __repr__(self) -> str:
        return f"Evaluation({', '.join(t.label for t in self.outputs)})"


def _persistent(node: Any) -> bool:
    """Whether a node's values outlive a routine: a parameter, data, optimizer state, a
    random stream's seed or counter, running statistics."""
    return bool(node.needs_init or node.zero_start or node.host_data is not None)


def compile_eval(ctx: Context, outputs: Tensor | Sequence[Tensor], *,
                 label: str = "evaluation") -> tuple[Context, Evaluation]:
    """Compile the forward code of ``outputs`` (an evaluation graph: a :class:`Model` built
    with ``train=False``, maybe a loss over it) on ``ctx``, reading the parameter buffers the
    training routines read. It allocates no gradient buffer; a graph whose forward code would
    write a node whose values persist (a parameter, a train-mode batch norm's statistics, a
    dropout's random-stream counter, data) is refused, naming the nodes, before anything is
    compiled: evaluating must change no training state."""
    outs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
    if not outs or not all(isinstance(t, Tensor) for t in outs):
        raise TypeError(f"compile_eval: outputs must be a Tensor or a sequence of Tensors, got "
                        f"{outputs!r:.200}")
    seen: set[int] = set()
    order = [t for o in outs for t in o.topo() if id(t) not in seen and not seen.add(id(t))]
    comp = Comp(tuple(a for t in order for a in t.forward_code), label)
    code = ctx.lower(comp)
    fx = effects(code)
    persistent = [n.name for n in fx.written if _persistent(n)]
    if persistent:
        raise ValueError(
            f"compile_eval: the graph of {', '.join(t.label for t in outs)} writes "
            f"{', '.join(persistent)}, whose values persist across steps: evaluating would "
            f"change training state (build the evaluation graph with train=False: batch norm "
            f"on its running statistics, dropout off)")
    grads = {t.grad.id for t in order if t.grad is not None}
    touched = [n.name for n in fx.inputs + fx.written if n.id in grads]
    assert not touched, f"forward code touches gradients {touched}"
    ctx, routine = ctx.compile_lowered(label, code)
    return ctx, Evaluation(routine, outs)
