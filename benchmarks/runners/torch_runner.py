"""PyTorch runners: eager; torch.compile of the forward pass and loss (backward through
AOTAutograd, the optimizer eager); and ``autocast``: eager with the forward pass and loss under
``torch.autocast(device_type="cpu", dtype=torch.bfloat16)``, the backward and the optimizer as
usual (the AMP recipe for bf16: f32 parameters, no GradScaler). All train the workload's model
(``benchmarks.models``) from the fixture's weights with the workload's optimizer
(torch.optim.SGD or Adam)."""

from __future__ import annotations

from benchmarks.fixtures import Fixture
from benchmarks.runners.base import Unavailable

VARIANTS = ("eager", "compile", "autocast")


def _autocast(loss_fn):  # noqa: ANN001, ANN202 - a (x, y) -> loss callable, wrapped
    """``loss_fn`` run under CPU autocast to bf16 (its products in bf16, the losses and
    normalizations in f32, as autocast's op lists say)."""
    import torch

    def run(x, y):  # noqa: ANN001, ANN202
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            return loss_fn(x, y)

    return run


class TorchRunner:
    """Same model as OCANNL's (``models.torch_model``), the same softmax cross-entropy
    (``models.torch_loss``), the same optimizer."""

    framework = "torch"

    def __init__(self, fx: Fixture, *, variant: str = "eager", device: str = "cpu") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"torch variant must be one of {list(VARIANTS)}, got {variant!r}")
        self.fx, self.variant, self.device = fx, variant, device
        self._loss = None

    def build(self) -> None:
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise Unavailable("torch sees no CUDA device")
        from benchmarks.models import torch_loss, torch_model, torch_optimizer

        dev = torch.device(self.device)
        w = self.fx.workload
        self.model = torch_model(w, self.fx.weights).to(dev)
        self.opt = torch_optimizer(w, self.model.parameters())
        self.xs = torch.from_numpy(self.fx.x).to(dev)
        self.ys = torch.from_numpy(self.fx.labels).to(dev)

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch_loss(w, self.model(x), y)

        self.loss_fn = torch.compile(loss_fn) if self.variant == "compile" else loss_fn
        if self.variant == "compile":
            self._check_compiles()
        elif self.variant == "autocast":
            self.loss_fn = _autocast(loss_fn)

    def _check_compiles(self) -> None:
        """Compile now (the first call), so build time is compile time; skip if it cannot."""
        try:
            self.loss_fn(self.xs[0], self.ys[0]).backward()
        except Exception as err:  # noqa: BLE001 - any compiler failure means: no row
            raise Unavailable(f"torch.compile failed: {type(err).__name__}: {err}") from err
        self.model.zero_grad()
        self.sync()

    def step(self, i: int) -> None:
        k = i % self.fx.workload.n_batches
        self.opt.zero_grad()
        loss = self.loss_fn(self.xs[k], self.ys[k])
        loss.backward()
        self.opt.step()
        self._loss = loss

    def loss(self) -> float:
        return float(self._loss.item())

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def mem_bytes(self) -> int | None:
        if self.device == "cuda":
            import torch

            return int(torch.cuda.max_memory_allocated())
        return None
