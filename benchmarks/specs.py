"""Workload specs: the model, data and hyperparameters each fixture is generated from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# Parity tolerances (max relative loss error against PyTorch CPU f32) by storage precision.
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 4e-3}

# This project's variants: name -> (compute precision, description).
VARIANTS = {
    "f32": ("f32", "f32 throughout"),
    "bf16": ("bf16", "bf16 twins of f32 master weights, no loss scaling"),
    "f16": ("f16", "f16 twins, loss scaling, per-step host gate"),
    "f16-static": ("f16", "f16 twins, fixed loss scale, no gate"),
    "f16-gated16": ("f16", "f16 twins, fused on-device gate, host check every 16 steps"),
}

# The other frameworks' rows: (framework, variant) -> (compute precision, description). The
# precision picks the row's parity tolerance; every row is gated against PyTorch CPU f32.
PEER_VARIANTS = {
    ("torch", "eager"): ("f32", "PyTorch eager, f32"),
    ("torch", "compile"): ("f32", "torch.compile of the forward pass and loss, f32"),
    ("torch", "autocast"): ("bf16", "PyTorch eager, forward and loss under "
                                    "torch.autocast(cpu, bfloat16), f32 parameters"),
    ("jax", "f32"): ("f32", "jax.jit of the whole step on the CPU, f32"),
    ("jax", "bf16"): ("bf16", "jax.jit of the whole step, bf16 compute over f32 parameters "
                              "(layer norms, softmax and loss in f32)"),
    ("tinygrad", "f32"): ("f32", "tinygrad's CPU device, the step under TinyJit, f32"),
}
# The peers beyond PyTorch: their rows run where their packages (the ``bench-peers`` extra)
# are installed, and say why not where they are not.
OTHER_PEERS = (("jax", "f32"), ("jax", "bf16"), ("tinygrad", "f32"))


def precision_of(framework: str, variant: str) -> str:
    """A row's compute precision ("f32", "bf16", "f16"): its parity tolerance's key."""
    if framework == "ocannl":
        if variant not in VARIANTS:
            raise ValueError(f"unknown ocannl variant {variant!r}: expected one of "
                             f"{list(VARIANTS)}")
        return VARIANTS[variant][0]
    if (framework, variant) not in PEER_VARIANTS:
        raise ValueError(f"unknown row {framework} {variant!r}: expected an ocannl variant or "
                         f"one of {sorted(PEER_VARIANTS)}")
    return PEER_VARIANTS[framework, variant][0]


# The variant timed twice per workload, the second runner as the A/A control: two identical
# rows in the same rounds differ only by the machine's noise, which their ratio measures (this
# one's denominator is that of the gate targets, the finest goals: 3%).
CONTROL_VARIANT = "f16-static"


@dataclass(frozen=True)
class Product:
    """A matrix product ``rows x inner`` by ``inner x cols``, ``batch`` of them side by side; a
    transposed operand is stored the other way round (as the step stores it)."""

    rows: int
    inner: int
    cols: int
    a_transposed: bool = False
    b_transposed: bool = False
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.inner * self.cols * self.batch


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: a model (``benchmarks.models``) on a dataset, trained with plain
    SGD or Adam, softmax cross-entropy (a gpt's: at every position, over the vocabulary)."""

    name: str
    # "half_moons", "gaussian_classes", "markov_chars" (generated) or "digits" (scikit-learn's)
    dataset: str
    # The MLP (of "mlp"; of "lenet", its head): input features, hidden..., classes.
    sizes: tuple[int, ...]
    batch: int
    n_batches: int  # distinct batches in the fixture; step i uses batch i % n_batches
    learning_rate: float
    seed: int
    parity_steps: int
    warmup_steps: int
    timed_steps: int  # per runner, split over the interleaved rounds
    rounds: int
    init_loss_scale: float = 1024.0
    growth_interval: int = 100_000  # large: no growth during a run, so no skipped steps
    model: str = "mlp"  # "mlp", "lenet" (``nn_blocks.lenet``) or "gpt" (``nn_blocks.gpt``)
    optimizer: str = "sgd"  # "sgd" (plain) or "adam" (torch's defaults but the lr)
    image: tuple[int, ...] = ()  # lenet: (height, width, channels), channels-last
    channels: tuple[int, ...] = ()  # lenet: each conv stage's output channels
    # gpt: tokens, sequence length (every sequence fills the context), width, attention heads
    # and decoder blocks (each block's MLP 4 * d_model wide). ``sizes`` stays empty.
    vocab: int = 0
    context: int = 0
    d_model: int = 0
    heads: int = 0
    layers: int = 0

    def __post_init__(self) -> None:
        if self.model == "gpt":
            dims = (self.vocab, self.context, self.d_model, self.heads, self.layers)
            if self.sizes or min(dims) < 1 or self.d_model % self.heads:
                raise ValueError(f"workload {self.name}: gpt needs empty sizes and positive "
                                 f"vocab, context, d_model, heads, layers with d_model a "
                                 f"multiple of heads, got sizes {self.sizes}, (vocab, context, "
                                 f"d_model, heads, layers) {dims}")
        elif self.model == "lenet":
            h, wd, _ = self.image
            cut = 2 ** len(self.channels)  # each stage: same conv, 2x2 pool
            flat = (h // cut) * (wd // cut) * self.channels[-1]
            if len(self.sizes) != 3 or self.sizes[0] != flat:
                raise ValueError(f"workload {self.name}: lenet's head must be sizes "
                                 f"({flat}, hidden, classes), got {self.sizes}")
        elif self.model != "mlp":
            raise ValueError(f"workload {self.name}: unknown model {self.model!r}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"workload {self.name}: unknown optimizer {self.optimizer!r}")

    @property
    def classes(self) -> int:
        """Classes per prediction: a gpt predicts one of ``vocab`` tokens at every position."""
        return self.vocab if self.model == "gpt" else self.sizes[-1]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One example's shape: an image's (height, width, channels), (features,), or a gpt's
        (context,) token ids."""
        if self.model == "gpt":
            return (self.context,)
        return self.image if self.model == "lenet" else self.sizes[:1]

    @property
    def d_ff(self) -> int:
        """The hidden width of a gpt block's MLP (``nn_blocks.gpt``'s default)."""
        return 4 * self.d_model

    def describe(self) -> str:
        """The model and optimizer in words, for reports."""
        if self.model == "gpt":
            net = (f"gpt: vocab {self.vocab}, context {self.context}, {self.layers} pre-norm "
                   f"causal decoder blocks of d_model {self.d_model}, {self.heads} heads, "
                   f"MLP {self.d_ff}; next-token cross-entropy over every position")
        elif self.model == "lenet":
            k = " -> ".join(f"conv3x3 {c} / relu / maxpool2" for c in self.channels)
            net = (f"lenet {'x'.join(map(str, self.image))} -> {k} -> flatten "
                   f"{' -> '.join(map(str, self.sizes))}")
        else:
            net = f"relu MLP {' -> '.join(map(str, self.sizes))}"
        opt = "plain SGD" if self.optimizer == "sgd" else "Adam"
        return f"{net}, {opt} at lr {self.learning_rate:g}"

    def gemm_products(self) -> list[Product]:
        """An MLP step's products, per layer of ``i`` inputs and ``o`` outputs at batch ``b``:
        the forward ``x @ w`` (b x i by i x o), the weight gradient ``x^T @ g`` (i x b by
        b x o) and, but for the first layer (its input is data), the input gradient
        ``g @ w^T`` (b x o by o x i)."""
        if self.model != "mlp":
            raise ValueError(f"workload {self.name}: gemm_products lists MLP layers only")
        b, out = self.batch, []
        for k, (i, o) in enumerate(zip(self.sizes[:-1], self.sizes[1:], strict=True)):
            out += [Product(b, i, o), Product(i, b, o, a_transposed=True)]
            if k:
                out.append(Product(b, o, i, b_transposed=True))
        return out

    def gemm_flops(self) -> int:
        """FLOPs of an MLP step's GEMMs (``gemm_products``)."""
        return sum(p.flops for p in self.gemm_products())

    def to_meta(self) -> dict[str, str]:
        return {k: repr(v) for k, v in asdict(self).items()}

    def fixture_meta(self) -> dict[str, str]:
        """The metadata fields that determine a fixture's tensors (not the step counts)."""
        keys = ("name", "dataset", "sizes", "batch", "n_batches", "learning_rate", "seed",
                "model", "image", "channels")
        if self.model == "gpt":  # only here, so the other fixtures' metadata stays as it was
            keys += ("vocab", "context", "d_model", "heads", "layers")
        return {k: v for k, v in self.to_meta().items() if k in keys}


WORKLOADS: dict[str, Workload] = {
    "mlp_small": Workload(
        name="mlp_small", dataset="half_moons", sizes=(2, 32, 32, 2), batch=32, n_batches=16,
        learning_rate=0.1, seed=1, parity_steps=20, warmup_steps=50, timed_steps=8000,
        # Rounds of 50 steps (under 1 ms a row): this machine's speed changes every few tens
        # of milliseconds, so many short rounds give every row the same mix. Three runs of
        # this workload alone each way, the A/A control's p50 off its twin's by: 40 rounds
        # 3.4%, 6.4%, 4.9%; 160 rounds 1.6%, 1.1%, 2.9% (about 35 s more a run). The larger
        # workloads' rounds are as many as their step times allow, for the same reason
        # (``OBSTACLES.md``).
        rounds=160,
    ),
    "mlp_wide": Workload(
        name="mlp_wide", dataset="gaussian_classes", sizes=(256, 1024, 1024, 10), batch=256,
        n_batches=8, learning_rate=0.01, seed=2, parity_steps=20, warmup_steps=5,
        timed_steps=160, rounds=40,
    ),
    # nn_blocks.lenet on scikit-learn's 8x8 digits (16 x 64 of them, a seeded draw), Adam at
    # torch's default lr: 8x8x1 -> conv 8 -> pool 4x4 -> conv 16 -> pool 2x2 -> 64 -> 64 -> 10.
    "convnet": Workload(
        name="convnet", dataset="digits", sizes=(64, 64, 10), batch=64, n_batches=16,
        learning_rate=1e-3, seed=3, parity_steps=20, warmup_steps=10, timed_steps=600,
        rounds=30, model="lenet", optimizer="adam", image=(8, 8, 1), channels=(8, 16),
    ),
    # nn_blocks.gpt, 2 blocks of d_model 128 with 4 heads, over 16 sequences of 64 tokens of a
    # synthetic character-level text (64 symbols, a seeded bigram chain: something to learn),
    # predicting each next token; Adam at 1e-3 (tests/test_convnet.py says why not larger).
    "gpt_mini": Workload(
        name="gpt_mini", dataset="markov_chars", sizes=(), batch=16, n_batches=8,
        learning_rate=1e-3, seed=4, parity_steps=20, warmup_steps=5, timed_steps=160,
        rounds=32, model="gpt", optimizer="adam", vocab=64, context=64, d_model=128, heads=4,
        layers=2,
    ),
}


def scaled(w: Workload, factor: float) -> Workload:
    """The same workload with fewer steps (for smoke tests and quick runs)."""
    if factor == 1.0:
        return w
    return replace(
        w,
        parity_steps=max(2, int(w.parity_steps * factor)),
        warmup_steps=max(1, int(w.warmup_steps * factor)),
        timed_steps=max(w.rounds, int(w.timed_steps * factor)),
    )
