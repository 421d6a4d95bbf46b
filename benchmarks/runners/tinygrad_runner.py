"""tinygrad's runner: its CPU device, f32, the training step (forward, loss, backward, the
optimizer's step) captured once by ``TinyJit`` and replayed.

The model is written here with tinygrad's tensors from the workload's spec, the same one the
other runners train (``benchmarks.models``): relu MLP, LeNet-style convnet (NCHW inside, as
PyTorch's twin), decoder-only transformer with an exact-erf gelu; the fixture's weights; plain
SGD or Adam (``tinygrad.nn.optim``, torch's defaults but the learning rate).

``TinyJit`` runs the step plainly on its first call and captures it on the second (both train
as any step does): they are the parity gate's first steps, and the warm-up's steps come after
them, so every timed step replays the captured one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks.fixtures import Fixture
from benchmarks.runners.base import Unavailable

VARIANTS = ("f32",)


def import_tinygrad() -> Any:
    """``tinygrad`` with a usable CPU device, or ``Unavailable`` saying why not (not installed:
    the ``bench-peers`` extra; its CPU device compiles with clang)."""
    try:
        import tinygrad
        from tinygrad import Device
    except ImportError as err:
        raise Unavailable(f"tinygrad is not installed ({err}); "
                          "pip install -e '.[bench-peers]'") from err
    try:
        Device["CPU"]
    except Exception as err:  # noqa: BLE001 - any reason its CPU device cannot start
        raise Unavailable(f"tinygrad's CPU device is unusable here (it compiles with clang): "
                          f"{type(err).__name__}: {err}") from err
    return tinygrad


def tinygrad_params(fx: Fixture) -> dict[str, Any] | list[tuple[Any, Any]]:
    """The fixture's weights as tinygrad parameters laid out for its ops (a linear weight
    ``(in, out)``, a kernel ``(out, in, k, k)``, a gpt's linear weights ``(in, out)``)."""
    from tinygrad import Tensor

    w = fx.workload

    def param(a: np.ndarray) -> Any:  # every float tensor in scope gets a gradient
        return Tensor(np.ascontiguousarray(a, np.float32), device="CPU")

    if isinstance(fx.weights, dict):
        params = {name: param(v.T if v.ndim == 2 and not name.endswith("_emb") else v)
                  for name, v in fx.weights.items()}
        return params
    n_conv = len(w.channels) if w.model == "lenet" else 0
    pairs = []
    for k, (wv, bv) in enumerate(fx.weights):
        pairs.append((param(wv.transpose(0, 3, 1, 2) if k < n_conv else wv.T), param(bv)))
    return pairs


def logits_of(w: Any, p: Any, x: Any) -> Any:
    """The workload's logits over ``x`` (features, channels-last images or token ids)."""
    if w.model == "gpt":
        return _gpt(w, p, x)
    h, fcs = x, p
    if w.model == "lenet":
        n_conv = len(w.channels)
        h = h.permute(0, 3, 1, 2)
        for kernel, bias in p[:n_conv]:
            h = h.conv2d(kernel, bias, padding=(kernel.shape[-1] - 1) // 2).relu()
            h = h.max_pool2d(kernel_size=(2, 2))
        h = h.permute(0, 2, 3, 1).flatten(1)  # channels-last flattening
        fcs = p[n_conv:]
    elif w.model != "mlp":
        raise ValueError(f"workload {w.name}: unknown model {w.model!r}")
    for k, (wt, b) in enumerate(fcs):
        h = h.linear(wt, b)
        if k < len(fcs) - 1:
            h = h.relu()
    return h


def _gpt(w: Any, p: dict[str, Any], ids: Any) -> Any:
    """``examples/torch_gpt.py``'s model in tinygrad's ops."""
    from tinygrad import Tensor

    b, s = ids.shape
    d, heads = w.d_model, w.heads
    dk = d // heads
    h = p["tok_emb"][ids] + p["pos_emb"][:s]
    later = Tensor.ones(s, s, device="CPU").triu(1).cast("bool")

    def norm(z: Any, prefix: str) -> Any:
        return z.layernorm(eps=1e-5) * p[prefix + "_gamma"] + p[prefix + "_beta"]

    def lin(z: Any, name: str, bias: str) -> Any:
        return z.linear(p[name], p[bias])

    for k in range(w.layers):
        q = f"block{k}."
        z = norm(h, q + "ln1")
        qh, kh, vh = (lin(z, q + f"w{m}", q + f"b{m}").reshape(b, s, heads, dk)
                      .transpose(1, 2) for m in "qkv")
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(dk)
        a = (later.where(-1e9, scores).softmax(-1) @ vh).transpose(1, 2).reshape(b, s, d)
        h = h + lin(a, q + "wo", q + "bo")
        u = lin(norm(h, q + "ln2"), q + "w1", q + "b1")
        h = h + lin(0.5 * u * (1 + (u / math.sqrt(2)).erf()), q + "w2", q + "b2")
    return lin(norm(h, "ln_f"), "head_w", "head_b")


class TinygradRunner:
    """The workload trained by a ``TinyJit``-captured step on tinygrad's CPU device."""

    framework = "tinygrad"

    def __init__(self, fx: Fixture, *, variant: str = "f32", device: str = "cpu") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"tinygrad variant must be one of {list(VARIANTS)}, got {variant!r}")
        if device != "cpu":
            raise ValueError(f"the tinygrad runner runs on the CPU only, got device {device!r}")
        self.fx, self.variant, self.device = fx, variant, device
        self._loss: Any = None

    def build(self) -> None:
        """Make the parameters, the optimizer and the jitted step (captured by its first calls,
        in the parity gate)."""
        import_tinygrad()
        from tinygrad import Context, Tensor, TinyJit, nn

        w = self.fx.workload
        self.params = tinygrad_params(self.fx)
        flat = (list(self.params.values()) if isinstance(self.params, dict)
                else [t for pair in self.params for t in pair])
        if w.optimizer == "sgd":
            self.opt = nn.optim.SGD(flat, lr=w.learning_rate)
        else:
            self.opt = nn.optim.Adam(flat, lr=w.learning_rate)
        x = self.fx.x.astype(np.int32) if w.model == "gpt" else self.fx.x
        self.xs = [Tensor(np.ascontiguousarray(xk), device="CPU").realize() for xk in x]
        self.ys = [Tensor(yk.astype(np.int32), device="CPU").realize() for yk in self.fx.labels]

        @TinyJit
        def step(xb: Any, yb: Any) -> Any:
            with Context(TRAINING=1):  # the optimizer refuses to step outside training
                self.opt.zero_grad()
                z = logits_of(w, self.params, xb)
                loss = z.reshape(-1, z.shape[-1]).sparse_categorical_crossentropy(
                    yb.reshape(-1))
                loss.backward()
                # the loss realized with the update, from the weights before it
                Tensor.realize(loss, *self.opt.schedule_step())
                return loss

        self._step = step

    def step(self, i: int) -> None:
        k = i % self.fx.workload.n_batches
        self._loss = self._step(self.xs[k], self.ys[k])

    def loss(self) -> float:
        return float(self._loss.item())

    def sync(self) -> None:
        from tinygrad import Device

        Device["CPU"].synchronize()

    def mem_bytes(self) -> int | None:
        return None
