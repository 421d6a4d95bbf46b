"""This project's runner: the whole training step (gradients and the workload's optimizer)
compiled into one routine (f32), or one of the mixed-precision recipes of ``ocannl.mixed_prec``
(see ``benchmarks.runners.mixed``). The model is the workload's (``benchmarks.models``)."""

from __future__ import annotations

from benchmarks.fixtures import Fixture
from benchmarks.runners.base import Unavailable
from benchmarks.specs import VARIANTS


def make_context(device: str):  # noqa: ANN201 - ocannl.Context, imported lazily
    """A context on ``device``; ``Unavailable`` when that device cannot be used here."""
    from ocannl import Context

    if device == "cpu":
        return Context.cpu()
    if device == "cuda":
        try:
            return Context.cuda()
        except Exception as err:  # noqa: BLE001 - any reason the GPU is unusable: skip
            raise Unavailable(f"no usable CUDA device: {type(err).__name__}: {err}") from err
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


class OcannlRunner:
    """Builds the workload's model (``models.ocannl_model``: ``nn_blocks.mlp``,
    ``nn_blocks.lenet`` or ``nn_blocks.gpt``) and trains it with the workload's optimizer
    (plain SGD or Adam)."""

    framework = "ocannl"

    def __init__(self, fx: Fixture, *, variant: str = "f32", device: str = "cpu",
                 control: bool = False) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}: expected one of {list(VARIANTS)}")
        self.fx, self.variant, self.device, self.control = fx, variant, device, control

    def build(self) -> None:
        from benchmarks import models

        w = self.fx.workload
        self.ctx = make_context(self.device)
        self.targets = models.feed_targets(self.fx)
        self.x, self.y = models.ocannl_io(w, self.fx)
        if self.variant == "f32":
            logits, self.layers = models.ocannl_model(w, self.x)
            self.loss_t = models.ocannl_loss(w, logits, self.y)
            self._set_weights(self.layers)
            self._step = self._f32_step()
        else:
            from benchmarks.runners.mixed import build_mixed

            self._step, self.loss_t = build_mixed(
                self, self.variant, lambda x: models.ocannl_model(w, x),
                models.ocannl_optimizer(w), lambda z, y: models.ocannl_loss(w, z, y))

    def _set_weights(self, layers: list) -> None:
        from benchmarks.models import set_ocannl_weights

        self.ctx = set_ocannl_weights(self.ctx, layers, self.fx.weights)

    def _f32_step(self):  # noqa: ANN202 - a zero-argument callable
        from benchmarks.models import ocannl_optimizer
        from ocannl import train

        opt = ocannl_optimizer(self.fx.workload)
        comp = train.grad_update(self.loss_t) + opt.update(self.loss_t)
        self.ctx, routine = self.ctx.compile(comp)
        ctx = self.ctx
        return lambda: ctx.run(routine)

    def feed(self, i: int) -> None:
        k = i % self.fx.workload.n_batches
        self.ctx.set_values(self.x, self.fx.x[k]).set_values(self.y, self.targets[k])

    def step(self, i: int) -> None:
        self.feed(i)
        self._step()

    def loss(self) -> float:
        return self.ctx.get_value(self.loss_t)

    def sync(self) -> None:
        """Reading one value waits for the device (a no-op on the CPU)."""
        if self.device != "cpu":
            self.ctx.get_value(self.loss_t)

    def mem_bytes(self) -> int | None:
        return self.ctx.mem()

    def mem_parts(self) -> dict[str, int]:
        """``mem_bytes`` by what holds it: the trained parameters (a mixed-precision step's
        f32 masters), their gradients, and the rest (16-bit twins, activations, data, the
        arena of local nodes). Only nodes the context already holds are counted."""
        held = {n.id for n in self.ctx.nodes()}
        params = [p.value for p in self.loss_t.params]
        grads = [p.grad for p in self.loss_t.params if p.grad is not None]
        parts = {what: sum(self.ctx.mem(n) for n in nodes if n.id in held)
                 for what, nodes in (("parameters", params), ("their gradients", grads))}
        parts["the rest"] = self.ctx.mem() - sum(parts.values())
        return parts
