"""This project's runner: the whole SGD step compiled into one routine (f32), or one of the
mixed-precision recipes of ``ocannl.mixed_prec`` (see ``benchmarks.runners.mixed``)."""

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
    """Builds the fixture's MLP with ``nn_blocks.mlp`` and trains it with plain SGD."""

    framework = "ocannl"

    def __init__(self, fx: Fixture, *, variant: str = "f32", device: str = "cpu") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}: expected one of {list(VARIANTS)}")
        self.fx, self.variant, self.device = fx, variant, device
        self.onehot = fx.onehot()

    def build(self) -> None:
        import ocannl.tensor as T
        from ocannl.nn_blocks import mlp, softmax_cross_entropy

        w = self.fx.workload
        self.ctx = make_context(self.device)
        x0, _ = self.fx.batch(0)
        self.x = T.term(x0, label="x")
        self.y = T.term(self.onehot[0], label="y")
        if self.variant == "f32":
            logits, self.layers = mlp(self.x, w.sizes[1:-1], w.classes, label="mlp")
            self.loss_t = softmax_cross_entropy(logits, self.y)
            self._set_weights(self.layers)
            self._step = self._f32_step()
        else:
            from benchmarks.runners.mixed import build_mixed

            self._step, self.loss_t = build_mixed(self, self.variant)

    def _set_weights(self, layers: list) -> None:
        for (wt, bt), (w, b) in zip(layers, self.fx.weights, strict=True):
            self.ctx = self.ctx.set_values(wt, w).set_values(bt, b)

    def _f32_step(self):  # noqa: ANN202 - a zero-argument callable
        from ocannl import train

        lr = self.fx.workload.learning_rate
        comp = train.grad_update(self.loss_t) + train.sgd_update(self.loss_t, learning_rate=lr)
        self.ctx, routine = self.ctx.compile(comp)
        ctx = self.ctx
        return lambda: ctx.run(routine)

    def feed(self, i: int) -> None:
        k = i % self.fx.workload.n_batches
        self.ctx.set_values(self.x, self.fx.x[k]).set_values(self.y, self.onehot[k])

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
