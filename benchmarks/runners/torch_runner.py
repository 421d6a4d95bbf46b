"""PyTorch runners: eager, and torch.compile of the forward pass and loss (backward through
AOTAutograd, SGD eager). Both train from the fixture's weights with torch.optim.SGD."""

from __future__ import annotations

from benchmarks.fixtures import Fixture
from benchmarks.runners.base import Unavailable


class TorchRunner:
    """Same model as OCANNL's: Linear / relu layers, softmax cross-entropy, plain SGD."""

    framework = "torch"

    def __init__(self, fx: Fixture, *, variant: str = "eager", device: str = "cpu") -> None:
        if variant not in ("eager", "compile"):
            raise ValueError(f"torch variant must be 'eager' or 'compile', got {variant!r}")
        self.fx, self.variant, self.device = fx, variant, device
        self._loss = None

    def build(self) -> None:
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise Unavailable("torch sees no CUDA device")
        dev = torch.device(self.device)
        layers: list[torch.nn.Module] = []
        for k, (w, b) in enumerate(self.fx.weights):
            lin = torch.nn.Linear(w.shape[1], w.shape[0])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w))
                lin.bias.copy_(torch.from_numpy(b))
            layers.append(lin)
            if k < len(self.fx.weights) - 1:
                layers.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(*layers).to(dev)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.fx.workload.learning_rate)
        self.xs = torch.from_numpy(self.fx.x).to(dev)
        self.ys = torch.from_numpy(self.fx.labels).to(dev)
        ce = torch.nn.functional.cross_entropy

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ce(self.model(x), y)

        self.loss_fn = torch.compile(loss_fn) if self.variant == "compile" else loss_fn
        if self.variant == "compile":
            self._check_compiles()

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
