"""Fixtures: the initial weights, the data and the hyperparameters of a workload, generated
from its seeded spec and stored as safetensors, so every runner trains from the same bits."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from benchmarks.specs import WORKLOADS, Workload
from ocannl import datasets

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures"


# A fixture's initial weights: (weight, bias) per layer, first layer first (mlp, lenet), or
# every parameter by ``nn_blocks.gpt``'s name (gpt).
Weights = list[tuple[np.ndarray, np.ndarray]] | dict[str, np.ndarray]


@dataclass(frozen=True)
class Fixture:
    """A loaded fixture. Weights are (weight, bias) per layer, first layer first: a linear
    layer's (out, in) like torch.nn.Linear's, a convolution's kernel (out, k, k, in); a gpt's
    are by parameter name, each in torch's layout (``gpt_shapes``)."""

    workload: Workload
    weights: Weights  # f32
    x: np.ndarray  # (n_batches, batch, *workload.input_shape) f32; a gpt's: int64 token ids
    labels: np.ndarray  # (n_batches, batch) int64; a gpt's: (n_batches, batch, context)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The inputs and integer labels step ``step`` trains on."""
        k = step % self.workload.n_batches
        return self.x[k], self.labels[k]

    def onehot(self) -> np.ndarray:
        """Labels as one-hot f32 targets, (n_batches, batch, classes)."""
        return np.eye(self.workload.classes, dtype=np.float32)[self.labels]


def weight_shapes(w: Workload) -> list[tuple[int, ...]]:
    """The weight (not bias) shape of every layer, first layer first (see ``Fixture``)."""
    shapes: list[tuple[int, ...]] = []
    if w.model == "lenet":
        c_in = w.image[-1]
        for c in w.channels:
            shapes.append((c, 3, 3, c_in))
            c_in = c
    return shapes + [(o, i) for i, o in zip(w.sizes[:-1], w.sizes[1:], strict=True)]


def gpt_shapes(w: Workload) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``nn_blocks.gpt`` by name, in its creation order, shaped as torch's
    twin holds it (a linear map's weight (out, in); ``gpt`` reshapes the attention's)."""
    d, f = w.d_model, w.d_ff
    shapes: dict[str, tuple[int, ...]] = {"tok_emb": (w.vocab, d), "pos_emb": (w.context, d)}
    for k in range(w.layers):
        block = {"ln1_gamma": (d,), "ln1_beta": (d,)}
        for m in "qkvo":
            block |= {f"w{m}": (d, d), f"b{m}": (d,)}
        block |= {"ln2_gamma": (d,), "ln2_beta": (d,), "w1": (f, d), "b1": (f,), "w2": (d, f),
                  "b2": (d,)}
        shapes |= {f"block{k}.{name}": shape for name, shape in block.items()}
    return shapes | {"ln_f_gamma": (d,), "ln_f_beta": (d,), "head_w": (w.vocab, d),
                     "head_b": (w.vocab,)}


def gpt_init(w: Workload, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``gpt_shapes``' parameters drawn as torch initialises its twin: embeddings N(0, 1),
    layer norms 1 and 0, a linear map's weight and bias uniform within ``1 / sqrt(fan_in)``."""
    out: dict[str, np.ndarray] = {}
    fan_in = 1
    for name, shape in gpt_shapes(w).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("_emb"):
            v = rng.standard_normal(shape)
        elif leaf.endswith("_gamma"):
            v = np.ones(shape)
        elif leaf.endswith("_beta"):
            v = np.zeros(shape)
        else:  # a weight (out, in), then its bias: the weight's fan-in bounds both
            if len(shape) == 2:
                fan_in = shape[1]
            bound = 1.0 / np.sqrt(fan_in)
            v = rng.uniform(-bound, bound, shape)
        out[name] = v.astype(np.float32)
    return out


def markov_chars(n: int, vocab: int, seed: int, successors: int = 4) -> np.ndarray:
    """``n`` tokens of a synthetic character-level text over ``vocab`` symbols: a seeded
    order-1 Markov chain in which each symbol is followed by one of ``successors`` symbols
    (drawn per symbol, with Dirichlet-drawn odds). A stand-in for text: a next-token model
    has structure to learn, and the tokens are the same on every machine."""
    rng = np.random.default_rng(seed)
    nxt = np.stack([rng.choice(vocab, size=successors, replace=False) for _ in range(vocab)])
    cdf = np.cumsum(rng.dirichlet(np.ones(successors), size=vocab), axis=1)
    picks = rng.random(n)
    out = np.empty(n, np.int64)
    tok = int(rng.integers(vocab))
    for i in range(n):
        k = min(int(np.searchsorted(cdf[tok], picks[i], side="right")), successors - 1)
        tok = out[i] = nxt[tok, k]
    return out


def digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` of scikit-learn's 8x8 digits (shipped with it, no download) in a seeded order:
    images (n, 8, 8, 1) scaled to [0, 1], and labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise RuntimeError("the digits workload needs scikit-learn (pip install scikit-learn)"
                           ) from err
    d = load_digits()
    if n > len(d.images):
        raise ValueError(f"digits: {n} images asked for, {len(d.images)} exist")
    pick = np.random.default_rng(seed).permutation(len(d.images))[:n]
    return (d.images[pick] / 16.0).reshape(n, 8, 8, 1), d.target[pick]


def generate(w: Workload) -> dict[str, np.ndarray]:
    """The fixture's tensors, drawn from ``w.seed`` (kaiming-uniform weights as torch's: bound
    ``1 / sqrt(fan_in)`` for weights and biases)."""
    rng = np.random.default_rng(w.seed)
    if w.model == "gpt":
        return gpt_tensors(w, rng)
    out: dict[str, np.ndarray] = {}
    for k, shape in enumerate(weight_shapes(w)):
        bound = 1.0 / np.sqrt(int(np.prod(shape[1:])))
        out[f"w{k}"] = rng.uniform(-bound, bound, shape).astype(np.float32)
        out[f"b{k}"] = rng.uniform(-bound, bound, shape[:1]).astype(np.float32)
    n = w.n_batches * w.batch
    if w.dataset == "half_moons":
        x, y = datasets.half_moons(n, seed=w.seed)
    elif w.dataset == "gaussian_classes":
        x, y = datasets.gaussian_classes(n, w.sizes[0], w.classes, seed=w.seed)
    elif w.dataset == "digits":
        x, y = digits(n, w.seed)
    else:
        raise ValueError(f"workload {w.name}: unknown dataset {w.dataset!r}")
    out["x"] = np.ascontiguousarray(x.reshape(w.n_batches, w.batch, *w.input_shape),
                                    np.float32)
    out["labels"] = y.reshape(w.n_batches, w.batch).astype(np.int64)
    return out


def gpt_tensors(w: Workload, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A gpt fixture's tensors: ``p.NAME`` per parameter, and ``n_batches * batch``
    consecutive windows of ``context + 1`` tokens of the text, ``x`` a window's first
    ``context`` tokens and ``labels`` its last (each position's next token)."""
    out = {f"p.{name}": v for name, v in gpt_init(w, rng).items()}
    if w.dataset != "markov_chars":
        raise ValueError(f"workload {w.name}: unknown gpt dataset {w.dataset!r}")
    n, s = w.n_batches * w.batch, w.context
    text = markov_chars(n * (s + 1), w.vocab, w.seed).reshape(w.n_batches, w.batch, s + 1)
    out["x"] = np.ascontiguousarray(text[..., :-1])
    out["labels"] = np.ascontiguousarray(text[..., 1:])
    return out


def path_of(w: Workload, folder: Path = FIXTURE_DIR) -> Path:
    return folder / f"{w.name}.safetensors"


def write(w: Workload, folder: Path = FIXTURE_DIR) -> Path:
    """Generate ``w``'s fixture and save it (hyperparameters in the file's metadata), whole or
    not at all: written under a name of this process's own, then renamed (processes that
    generate one fixture at once, the test suite's workers, never read a half-written file)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = path_of(w, folder)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(generate(w), str(tmp), metadata=w.to_meta())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _stored_meta(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as fh:
        return dict(fh.metadata() or {})


def load(w: Workload, folder: Path = FIXTURE_DIR) -> Fixture:
    """Load ``w``'s fixture, (re)generating it when absent or made from another spec."""
    path = path_of(w, folder)
    want = w.fixture_meta()
    if not path.exists() or {k: _stored_meta(path).get(k) for k in want} != want:
        write(w, folder)
    return from_tensors(w, load_file(str(path)))


def from_tensors(w: Workload, t: dict[str, np.ndarray]) -> Fixture:
    """A fixture from its tensors (as ``generate`` makes them and ``write`` stores them)."""
    weights: Weights
    if w.model == "gpt":
        weights = {name: t[f"p.{name}"] for name in gpt_shapes(w)}
    else:
        weights = [(t[f"w{k}"], t[f"b{k}"]) for k in range(len(weight_shapes(w)))]
    return Fixture(w, weights, t["x"], t["labels"])


def main() -> None:
    """Generate every workload's fixture."""
    for w in WORKLOADS.values():
        print(f"{w.name}: {write(w)}")


if __name__ == "__main__":
    main()
