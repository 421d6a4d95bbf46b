"""JAX's runner: the whole training step (forward, loss, gradients, the optimizer's update)
under one ``jax.jit`` on the CPU, in f32 or with bf16 compute.

The model is written here in ``jax.numpy`` from the workload's spec (``benchmarks.models``
says what each model computes): the same relu MLP, LeNet-style convnet (channels-last, 3x3
"same" convolutions, 2x2 max pools) and decoder-only transformer as the other runners, from
the fixture's weights, trained with plain SGD or Adam as ``torch.optim`` computes them.

``bf16``: the f32 parameters stay the masters; the step casts them and the input to bf16 for
the products and the pointwise work, keeps layer norms, the attention's softmax and the loss
in f32 (as ``torch.autocast`` does), and the gradients arrive in f32 through the casts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks.fixtures import Fixture
from benchmarks.runners.base import Unavailable

VARIANTS = ("f32", "bf16")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults


def import_jax() -> Any:
    """``jax`` on its CPU device, or ``Unavailable`` saying why not (not installed: the
    ``bench-peers`` extra)."""
    try:
        import jax
    except ImportError as err:
        raise Unavailable(f"jax is not installed ({err}); pip install -e '.[bench-peers]'"
                          ) from err
    try:
        jax.devices("cpu")
    except RuntimeError as err:
        raise Unavailable(f"jax has no CPU device: {err}") from err
    return jax


def jax_params(fx: Fixture) -> Any:
    """The fixture's weights as JAX's parameters: (weight, bias) pairs, or a gpt's by name."""
    import jax.numpy as jnp

    if isinstance(fx.weights, dict):
        return {k: jnp.asarray(v, jnp.float32) for k, v in fx.weights.items()}
    return [(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32)) for w, b in fx.weights]


def logits_of(w: Any, params: Any, x: Any, dtype: Any) -> Any:
    """The workload's logits (f32) over input ``x``, the parameters cast to ``dtype``."""
    import jax
    import jax.numpy as jnp

    p = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    if w.model == "gpt":
        return _gpt(w, p, x, dtype).astype(jnp.float32)
    h = x.astype(dtype)
    fcs = p
    if w.model == "lenet":
        n_conv = len(w.channels)
        for kernel, bias in p[:n_conv]:
            h = jax.lax.conv_general_dilated(h, kernel, (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "OHWI", "NHWC"))
            h = jax.nn.relu(h + bias)
            h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                      "VALID")
        h = h.reshape(h.shape[0], -1)  # channels-last flattening, as the fixture's head reads
        fcs = p[n_conv:]
    elif w.model != "mlp":
        raise ValueError(f"workload {w.name}: unknown model {w.model!r}")
    for k, (wt, b) in enumerate(fcs):
        h = h @ wt.T + b
        if k < len(fcs) - 1:
            h = jax.nn.relu(h)
    return h.astype(jnp.float32)


def _layer_norm(h: Any, gamma: Any, beta: Any) -> Any:
    """Layer norm over the last axis (eps 1e-5) in f32, back in ``h``'s dtype."""
    import jax.numpy as jnp

    z = h.astype(jnp.float32)
    mu = z.mean(-1, keepdims=True)
    var = ((z - mu) ** 2).mean(-1, keepdims=True)
    out = (z - mu) / jnp.sqrt(var + 1e-5) * gamma.astype(jnp.float32) + beta.astype(jnp.float32)
    return out.astype(h.dtype)


def _gpt(w: Any, p: dict[str, Any], ids: Any, dtype: Any) -> Any:
    """``examples/torch_gpt.py``'s model: embeddings, pre-norm causal attention blocks with an
    exact-erf gelu MLP, a final layer norm and a linear head."""
    import jax
    import jax.numpy as jnp

    b, s = ids.shape
    d, heads = w.d_model, w.heads
    dk = d // heads
    h = p["tok_emb"][ids] + p["pos_emb"][:s]
    later = jnp.triu(jnp.ones((s, s), bool), 1)

    def lin(z: Any, name: str, bias: str) -> Any:
        return z @ p[name].T + p[bias]

    for k in range(w.layers):
        q = f"block{k}."
        z = _layer_norm(h, p[q + "ln1_gamma"], p[q + "ln1_beta"])
        qh, kh, vh = (lin(z, q + f"w{m}", q + f"b{m}").reshape(b, s, heads, dk)
                      .transpose(0, 2, 1, 3) for m in "qkv")
        scores = (qh @ kh.transpose(0, 1, 3, 2)).astype(jnp.float32) / math.sqrt(dk)
        att = jax.nn.softmax(jnp.where(later, -1e9, scores), axis=-1).astype(dtype)
        a = (att @ vh).transpose(0, 2, 1, 3).reshape(b, s, d)
        h = h + lin(a, q + "wo", q + "bo")
        z = _layer_norm(h, p[q + "ln2_gamma"], p[q + "ln2_beta"])
        h = h + lin(jax.nn.gelu(lin(z, q + "w1", q + "b1"), approximate=False),
                    q + "w2", q + "b2")
    return lin(_layer_norm(h, p["ln_f_gamma"], p["ln_f_beta"]), "head_w", "head_b")


def cross_entropy(logits: Any, labels: Any) -> Any:
    """Mean softmax cross-entropy of f32 logits (..., classes) against integer labels (...)."""
    import jax
    import jax.numpy as jnp

    z = logits.reshape(-1, logits.shape[-1])
    picked = jnp.take_along_axis(z, labels.reshape(-1, 1), axis=1)[:, 0]
    return (jax.nn.logsumexp(z, axis=1) - picked).mean()


def make_step(w: Any, dtype: Any) -> Any:
    """The training step ``(params, state, x, labels) -> (params, state, loss)`` (not yet
    jitted); ``state``: Adam's moments and step count (torch's update), or None for SGD."""
    import jax
    import jax.numpy as jnp

    lr = w.learning_rate

    def loss_fn(params: Any, x: Any, labels: Any) -> Any:
        return cross_entropy(logits_of(w, params, x, dtype), labels)

    def step(params: Any, state: Any, x: Any, labels: Any) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
        if w.optimizer == "sgd":
            return jax.tree_util.tree_map(lambda a, g: a - lr * g, params, grads), state, loss
        m, v, t = state
        b1, b2 = ADAM_BETAS
        t = t + 1.0
        m = jax.tree_util.tree_map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
        step_size = lr / (1 - b1**t)
        root_bc2 = jnp.sqrt(1 - b2**t)
        params = jax.tree_util.tree_map(
            lambda a, m_, v_: a - step_size * m_ / (jnp.sqrt(v_) / root_bc2 + ADAM_EPS),
            params, m, v)
        return params, (m, v, t), loss

    return step


class JaxRunner:
    """The workload trained by one jitted step on JAX's CPU device."""

    framework = "jax"

    def __init__(self, fx: Fixture, *, variant: str = "f32", device: str = "cpu") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"jax variant must be one of {list(VARIANTS)}, got {variant!r}")
        if device != "cpu":
            raise ValueError(f"the jax runner runs on the CPU only, got device {device!r}")
        self.fx, self.variant, self.device = fx, variant, device
        self._loss: Any = None

    def build(self) -> None:
        """Put the fixture on the device and compile the step (ahead of time: no step runs)."""
        jax = import_jax()
        import jax.numpy as jnp

        w = self.fx.workload
        cpu = jax.devices("cpu")[0]
        dtype = jnp.bfloat16 if self.variant == "bf16" else jnp.float32
        with jax.default_device(cpu):
            self.params = jax_params(self.fx)
            self.state = None
            if w.optimizer == "adam":
                zeros = jax.tree_util.tree_map(jnp.zeros_like, self.params)
                self.state = (zeros, jax.tree_util.tree_map(jnp.zeros_like, self.params),
                              jnp.zeros((), jnp.float32))
            x = self.fx.x.astype(np.int32) if w.model == "gpt" else self.fx.x
            self.xs = [jax.device_put(xk, cpu) for xk in x]
            self.ys = [jax.device_put(yk.astype(np.int32), cpu) for yk in self.fx.labels]
            jitted = jax.jit(make_step(w, dtype))
            self._step = jitted.lower(self.params, self.state, self.xs[0], self.ys[0]).compile()

    def step(self, i: int) -> None:
        k = i % self.fx.workload.n_batches
        self.params, self.state, self._loss = self._step(self.params, self.state, self.xs[k],
                                                         self.ys[k])

    def loss(self) -> float:
        return float(self._loss)

    def sync(self) -> None:
        if self._loss is not None:
            self._loss.block_until_ready()

    def mem_bytes(self) -> int | None:
        return None
