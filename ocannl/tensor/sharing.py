"""One set of parameters for several builds of a model: the first build of a model-building
function records every parameter (and every state buffer, such as batch-norm running
statistics) it creates, by label; a later build over another input (another batch size, the
evaluation mode) gets the same tensors back instead of new ones, so its routines read and
write the same buffers.

Ambiguity is refused, never guessed: two parameters of one label in the first build, a
parameter a later build asks for with another shape, precision or init, or one the first
build did not create, each raise ``ValueError`` naming it. Which block created each
parameter is recorded too (``block_path``), for ``ocannl.summary``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from ocannl.tensor.tensor import Tensor

__all__ = ["InlineParams", "ParamScope", "active_scope", "block_path", "current_blocks", "op",
           "param_prefix", "shared_state"]


class ParamScope:
    """The parameters and state buffers of one model, by label. ``recording`` while the first
    build runs; afterwards every build reuses what it recorded (see the module docstring)."""

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self.recording = True
        self.params: dict[str, Tensor] = {}
        self.states: dict[str, Tensor] = {}
        self._specs: dict[str, tuple[Any, ...]] = {}
        self._used: set[str] = set()  # labels handed out during the current reuse build

    def begin_reuse(self) -> None:
        self.recording = False
        self._used = set()

    def _take(self, kind: str, label: str, spec: tuple[Any, ...], shown: str) -> Tensor:
        table = self.params if kind == "parameter" else self.states
        if label not in table:
            raise ValueError(
                f"{self.name}: this build creates {kind} {label!r}, which the model's first "
                f"build did not create: a model's parameters must not depend on its input or "
                f"mode (first build's {kind}s: {sorted(table) or 'none'})")
        if label in self._used:
            raise ValueError(
                f"{self.name}: this build asks for {kind} {label!r} twice: two {kind}s of one "
                f"label cannot be told apart (give each block its own label=)")
        if self._specs[f"{kind}:{label}"] != spec:
            raise ValueError(
                f"{self.name}: {kind} {label!r} is asked for as {shown}, but the first build "
                f"created it as {self._specs[f'{kind}:{label}:shown']}: the shared {kind} "
                f"would differ")
        self._used.add(label)
        return table[label]

    def _record(self, kind: str, label: str, t: Tensor, spec: tuple[Any, ...],
                shown: str) -> None:
        table = self.params if kind == "parameter" else self.states
        if label in table:
            raise ValueError(
                f"{self.name}: two {kind}s are labelled {label!r} in the model's first build: "
                f"a later build could not tell which to reuse (give each block its own label=)")
        table[label] = t
        self._specs[f"{kind}:{label}"] = spec
        self._specs[f"{kind}:{label}:shown"] = shown  # type: ignore[assignment]

    def param(self, label: str, spec: tuple[Any, ...], shown: str,
              make: Callable[[], Tensor]) -> Tensor:
        """The parameter ``label``: made (and recorded) at the first build, the recorded one
        at a later build (its spec checked)."""
        if not self.recording:
            return self._take("parameter", label, spec, shown)
        t = make()
        self._record("parameter", label, t, spec, shown)
        return t

    def state(self, label: str, spec: tuple[Any, ...], shown: str,
              make: Callable[[], Tensor]) -> Tensor:
        if not self.recording:
            return self._take("state buffer", label, spec, shown)
        t = make()
        self._record("state buffer", label, t, spec, shown)
        return t


active_scope: ContextVar[ParamScope | None] = ContextVar("active_param_scope", default=None)

# The blocks (``nn_blocks``' decorated functions) being built, outermost first.
current_blocks: ContextVar[tuple[str, ...]] = ContextVar("current_blocks", default=())

# Parameter value node -> the blocks that were being built when it was created.
_BLOCK_PATHS: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def record_block_path(t: Tensor) -> None:
    path = current_blocks.get()
    if path:
        _BLOCK_PATHS[t.value] = path


def block_path(t: Tensor) -> tuple[str, ...]:
    """The blocks, outermost first, that were being built when parameter ``t`` was created
    (empty for one created outside any block)."""
    return _BLOCK_PATHS.get(t.value, ())


def shared_state(label: str, make: Callable[[], Tensor], *, dims: tuple[int, ...],
                 prec: Any) -> Tensor:
    """A state buffer (a tensor the forward code updates across steps, not trained: batch-norm
    running statistics): ``make()`` outside a model scope and at a model's first build, the
    recorded tensor at a later build (its dims and precision checked)."""
    scope = active_scope.get()
    if scope is None:
        return make()
    p = getattr(prec, "value", prec)
    spec = (tuple(dims), p)
    return scope.state(label, spec, f"dims {tuple(dims)}, {p}", make)


class InlineParams:
    """A function whose parameters are written inline (``T.param("w")`` in its body), made
    once and shared by every call: upstream's ``%op``. The first call creates them; each
    later call gets the same ones back, by label, as a :class:`~ocannl.model.Model`'s later
    builds do (a label created twice in one call, or one the first call did not create, is
    refused, naming it). Two layers of one function are two instances: ``layer.fresh("l2")``
    (its parameters' labels prefixed ``l2_``)."""

    def __init__(self, fn: Callable[..., Any], *, label: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"op: expected a function, got {type(fn).__name__}: {fn!r:.60}")
        self.fn = fn
        self.label = label
        self.name = label or getattr(fn, "__name__", "op")
        self.scope = ParamScope(f"op {self.name}")
        self.calls = 0
        self.__doc__ = getattr(fn, "__doc__", None)

    def fresh(self, label: str) -> InlineParams:
        """Another instance of this function, with parameters of its own labelled
        ``{label}_{param}``."""
        return InlineParams(self.fn, label=label)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.calls:
            self.scope.begin_reuse()
        token = active_scope.set(self.scope)
        prefix = param_prefix.set(f"{param_prefix.get()}{self.label}_" if self.label else
                                  param_prefix.get())
        try:
            out = self.fn(*args, **kwargs)
        except BaseException:
            if not self.calls:  # a failed first call records nothing
                self.scope = ParamScope(f"op {self.name}")
            raise
        finally:
            param_prefix.reset(prefix)
            active_scope.reset(token)
        self.calls += 1
        return out

    @property
    def params(self) -> list[Tensor]:
        """The parameters its first call created, in creation order."""
        return list(self.scope.params.values())


# The label prefix of the inline parameters being made (an ``InlineParams.fresh`` instance's).
param_prefix: ContextVar[str] = ContextVar("param_prefix", default="")


def op(fn: Callable[..., Any]) -> InlineParams:
    """Decorator: ``fn``'s inline parameters are made at its first call and shared by every
    later one (see :class:`InlineParams`)."""
    return InlineParams(fn)
