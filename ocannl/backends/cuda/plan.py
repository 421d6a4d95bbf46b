"""The CUDA backend: CUDA C kernels generated from the lowered loop nests, run through CuPy.

Every lowered item becomes a launch plan (:func:`plan_routine`) built without a GPU: each loop
nest is one kernel (two for a long reduction split across blocks), each GEMM a cuBLAS call
(``gemmEx``; a batched one ``gemmStridedBatchedEx``): f16 / bf16 operands as stored, into an
f32 result (a 16-bit target is rounded from it by a nest: ``ocannl.ir.schedule``). Kernel
bodies come from :mod:`ocannl.backends.emit` with a C flavour; the wrapping is this module's,
as scheduling mapped each group (``LoopGroup.mapping``): threads over the written cells
(grid-stride), a reduction serial within a thread, or a block reduction (warp shuffles, then
shared memory; cut over several blocks with a deterministic second pass where scheduling cut
it). There are no atomics, so a routine computes the same bits on every run.

Buffers are flat CuPy arrays: f64 / f32 / f16 as such, bf16 as uint16 bit patterns (the kernels
read both 16-bit kinds through ``__half`` / ``__nv_bfloat16`` pointers; arithmetic is f32).
CuPy is imported only when a backend is created: the sources can be generated and checked
with NVRTC (:mod:`ocannl.backends.cuda.nvrtc`) on a machine with no GPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ocannl.backends import core
from ocannl.backends.emit import CSpelling, NestBody, float_literal, nest_body
from ocannl.errors import require_bool
from ocannl.ir.assignments import Accum, Comp
from ocannl.ir.lowering import Fill, Gemm, LoopGroup, Lowered, access, lower, stored_in
from ocannl.ir.ops import Precision
from ocannl.ir.schedule import MAX_GRID, WARP
from ocannl.ir.target import Target
from ocannl.ir.tnode import Tnode

# --- launch geometry: which threads run what, and in which blocks, is scheduling's choice
# (``LoopGroup.mapping``, ``grid``, ``block``: ``ocannl.ir.schedule``) -------------------------

BLOCK = 256  # this target's threads per block (``Target.gpu_block``)
SMS = 132  # an H200's multiprocessors (``Target.gpu_sms``)

_CTYPE = {Precision.f64: "double", Precision.f32: "float", Precision.f16: "__half",
          Precision.bf16: "__nv_bfloat16"}
_WIDEN = {Precision.f16: "__half2float", Precision.bf16: "__bfloat162float"}
_NARROW = {Precision.f16: "__float2half_rn", Precision.bf16: "__float2bfloat16_rn"}
_INCLUDE = {Precision.f16: "cuda_fp16.h", Precision.bf16: "cuda_bf16.h"}



# --- the C flavour of the shared emitter --------------------------------------------------------


class CudaFlavour(CSpelling):
    """CUDA C: 16-bit buffers load through ``__half2float`` / ``__bfloat162float`` and store
    rounding to nearest even; every load is converted to the nest's compute precision (that
    of its written node), so an expression is all ``float`` or all ``double``: C++ overloads
    such as ``pow(double, float)`` would otherwise be ambiguous. Locals are ``auto``."""

    widen = _WIDEN
    narrow = _NARROW

    def __init__(self, nodes: list[Tnode], compute: Precision = Precision.f32,
                 registers: dict[int, str] | None = None) -> None:
        super().__init__(nodes, registers)
        self.compute = compute

    def literal(self, value: float, compute: Precision) -> str:
        if compute is Precision.f64:
            if math.isnan(value):
                return "__longlong_as_double(0x7ff8000000000000LL)"
            if math.isinf(value):
                inf = "__longlong_as_double(0x7ff0000000000000LL)"
                return inf if value > 0 else f"(-{inf})"
            text = float_literal(value)
        else:
            with np.errstate(over="ignore"):
                v = float(np.float32(value))  # the f32 the CPU's IR constant holds
            if math.isnan(v):
                return "__int_as_float(0x7fc00000)"
            if math.isinf(v):
                return "__int_as_float(0x7f800000)" if v > 0 else "(-__int_as_float(0x7f800000))"
            text = float_literal(v) + "f"
        return f"({text})" if text.startswith("-") else text

    def convert(self, ref: str, node: Tnode, compute: Precision) -> str:
        return ref if node.prec.compute is self.compute else f"(({_CTYPE[self.compute]}){ref})"

    def declare(self, name: str, value: str, compute: Precision) -> str:
        return f"auto {name} = {value};"


# --- launch plans -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scratch:
    """A device work buffer owned by a routine (reduction partials, widened GEMM operands)."""

    slot: int
    size: int
    prec: Precision


@dataclass(frozen=True)
class Kernel:
    """One kernel launch: its source (function ``name``), launch shape, and its pointer
    parameters: the nodes' buffers, then the scratch buffers."""

    kind: str  # fill, map, serial, reduce, partial, final
    name: str
    source: str
    grid: int
    block: int
    nodes: tuple[Tnode, ...]
    scratch: tuple[Scratch, ...] = ()


@dataclass(frozen=True)
class GemmCall:
    """``out (+)= op(a) @ op(b)`` through cuBLAS (``gemmEx``, or ``gemmStridedBatchedEx`` over
    the product's batch axes), over the product's own nodes: operands of the target's
    precision, or f16 / bf16 ones as stored into an f32 target."""

    gemm: Gemm
    beta: float


Step = Kernel | GemmCall


@dataclass(frozen=True)
class Plan:
    """Everything a routine launches, in order, and the scratch buffers it needs."""

    steps: tuple[Step, ...]
    scratch: tuple[Scratch, ...]

    @property
    def kernels(self) -> list[Kernel]:
        return [s for s in self.steps if isinstance(s, Kernel)]

    def sources(self) -> list[str]:
        """The distinct kernel sources, in first-use order."""
        return list(dict.fromkeys(k.source for k in self.kernels))


def _index_type(*sizes: int) -> str:
    return "int" if max(sizes, default=1) < 2**31 - 2 * MAX_GRID * BLOCK else "long long"


def _uses(text: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def _decompose(lin: str, iters: Sequence[int], space: tuple[int, ...], names: dict[int, str],
               ity: str, body: str) -> list[str]:
    """Declarations of the iterators ``iters`` (last fastest) from the linear index ``lin``;
    only those the body mentions, each computed on its own so unused ones cost nothing."""
    out = []
    stride = 1
    for k in reversed(range(len(iters))):
        i = iters[k]
        n = space[i]
        if _uses(body, names[i]):
            if n == 1:
                value = "0"
            else:
                q = lin if stride == 1 else f"({lin} / {stride})"
                value = q if k == 0 else f"{q} % {n}"
            out.append(f"const {ity} {names[i]} = {value};")
        stride *= n
    return list(reversed(out))


def _signature(name: str, nodes: Sequence[Tnode], scratch: Sequence[Scratch], block: int) -> str:
    includes = sorted({_INCLUDE[n.prec] for n in nodes if n.prec.is_narrow})
    params = [f"{_CTYPE[n.prec]}* __restrict__ b{k}" for k, n in enumerate(nodes)]
    params += [f"{_CTYPE[s.prec]}* __restrict__ s{k}" for k, s in enumerate(scratch)]
    head = "".join(f"#include <{h}>\n" for h in includes)
    return (f"{head}extern \"C\" __global__ void __launch_bounds__({block}) "
            f"{name}({', '.join(params)}) {{")


def _with_includes(src: str) -> str:
    """``src`` with the header of each 16-bit type its text uses and its signature does not
    include already: a read rounded to f16 or bf16 (``Get.rounded``) uses the type's
    conversions with no node of that precision among the kernel's parameters."""
    head = "".join(f"#include <{_INCLUDE[p]}>\n" for p in (Precision.f16, Precision.bf16)
                   if f"#include <{_INCLUDE[p]}>" not in src
                   and (_WIDEN[p] in src or _NARROW[p] in src))
    return head + src


def _indent(lines: list[str], depth: int) -> list[str]:
    return ["  " * depth + s for s in lines]


def _block_reduce(f: CudaFlavour, accum: str, acc_type: str, block: int) -> list[str]:
    """Combine every thread's ``acc`` into thread 0's: shuffles within warps, then the warp
    results through shared memory ``sh`` and one more round of shuffles in warp 0."""
    comb = core.combine(f, accum, "acc", "other", f.compute)
    shuffle = [
        "for (int o = 16; o > 0; o >>= 1) {",
        f"  const {acc_type} other = __shfl_down_sync(0xffffffffu, acc, o);",
        f"  acc = {comb};",
        "}",
    ]
    return [
        *shuffle,
        "if (lane == 0) sh[warp] = acc;",
        "__syncthreads();",
        "if (warp == 0) {",
        f"  acc = lane < {block // WARP} ? sh[lane] : "
        f"{f.literal(core.neutral(accum), f.compute)};",
        *_indent(shuffle, 1),
        "}",
    ]


class _Planner:
    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.scratch: list[Scratch] = []

    def slot(self, size: int, prec: Precision) -> Scratch:
        s = Scratch(len(self.scratch), size, prec)
        self.scratch.append(s)
        return s

    # -- fills and conversions --

    def fill(self, item: Fill) -> None:
        node = item.node
        f = CudaFlavour([node], node.prec.compute)
        ity = _index_type(node.size)
        grid, block = item.grid, item.block
        lit = f.literal(item.value, node.prec.compute)
        body = [
            f"for ({ity} p = ({ity})blockIdx.x * {block} + threadIdx.x; p < {node.size}; "
            f"p += ({ity})gridDim.x * {block}) {{",
            "  " + f.store_text(node, "p", lit),
            "}",
        ]
        src = "\n".join([_signature("ocannl_fill", [node], [], block), *_indent(body, 1), "}"])
        self.steps.append(Kernel("fill", "ocannl_fill", src + "\n", grid, block, (node,)))

    # -- GEMMs --

    def gemm(self, g: Gemm) -> None:
        """A cuBLAS call over the product's nodes as lowering left them: operands in the
        target's precision (f32 or f64), or both in one 16-bit precision of
        ``cuda_target().native_products`` into an f32 target (``schedule.native_operands``),
        read as stored; batch axes become strided-batched calls. Anything else is refused."""
        lhs = g.assign.lhs
        pa, pb = g.a.node.prec, g.b.node.prec
        native = pa is pb and pa in NATIVE_PRODUCTS and lhs.prec is Precision.f32
        if g.kernel != "blas" or not (native or (pa is pb is lhs.prec and not pa.is_narrow)):
            raise ValueError(
                f"the CUDA plan multiplies through cuBLAS f32 or f64 operands into a target of "
                f"their precision, or f16 / bf16 operands of one precision into an f32 target; "
                f"got {g.a.node.name} ({pa.value}) @ {g.b.node.name} ({pb.value}) into "
                f"{lhs.name} ({lhs.prec.value}), kernel {g.kernel!r}: lower it for "
                f"cuda_target()")
        for v, rows, cols in ((g.a, g.rows, g.inner), (g.b, g.inner, g.cols)):
            stored = rows if v.transposed else cols
            if v.ld < max(1, stored):
                raise ValueError(f"product operand {v.node.name}: rows {v.ld} apart, shorter "
                                 f"than its stored rows of {stored}")
        if g.out_ld < max(1, g.cols):
            raise ValueError(f"product target {lhs.name}: rows {g.out_ld} apart, shorter than "
                             f"its {g.cols} columns")
        beta = 0.0 if g.assign.reset else 1.0
        self.steps.append(GemmCall(g, beta))

    # -- loop nests --

    def group(self, group: LoopGroup) -> None:
        """One kernel for a loop group: threads over the parallel iterators lowering chose, each
        running every nest's body at its point (a nest with a long reduction: a block reduction
        instead, see :meth:`reduce`)."""
        lead = group.lead
        a = lead.assign
        par, red = list(lead.par), list(lead.red)
        strategy = group.mapping
        if not strategy:
            raise ValueError(f"a loop group writing {a.lhs.name} was lowered for a target "
                             f"without a GPU's threads (no LoopGroup.mapping): lower it for "
                             f"cuda_target()")
        # Nodes handed over in registers (lowering's choice) are locals of the point's loop
        # body, with no buffer.
        held = {n.id: n for n in access(group).nodes if n.id in group.registers}
        regs = {i: f"r{k}" for k, i in enumerate(held)}
        nodes = stored_in(group)
        names = {i: f"i{i}" for i in range(len(a.space))}
        bodies = [nest_body(m, CudaFlavour(nodes, m.assign.lhs.prec.compute, regs), names)
                  for m in group.nests]
        if strategy == "reduce":
            (body,) = bodies
            self.reduce(a, nodes, CudaFlavour(nodes, a.lhs.prec.compute), names, par, red, body,
                        (group.reduce_splits, group.reduce_chunk), (group.grid, group.block))
            return
        if len(bodies) > 1:  # each fused body in its own scope: their locals share names
            declared = [f"{_CTYPE[n.prec.compute]} {regs[i]};" for i, n in held.items()]
            body = NestBody([], declared + [x for b in bodies
                                            for x in ["{", *_indent(b.inner, 1), "}"]], [])
        else:
            (body,) = bodies
        ity = _index_type(math.prod(a.space), *(n.size for n in nodes))
        grid, block = group.grid, group.block
        inner: list[str] = []
        loops = [i for i in red if a.space[i] > 1]
        for depth, i in enumerate(loops):
            inner.append("  " * depth + f"for ({ity} {names[i]} = 0; {names[i]} < {a.space[i]}; "
                         f"++{names[i]}) {{")
        inner += _indent(body.inner, len(loops))
        inner += ["  " * d + "}" for d in reversed(range(len(loops)))]
        text = "\n".join(body.init + inner + body.final)
        ones = [f"const {ity} {names[i]} = 0;" for i in red
                if a.space[i] == 1 and _uses(text, names[i])]
        decl = _decompose("p", par, a.space, names, ity, text)
        lines = [
            f"for ({ity} p = ({ity})blockIdx.x * {block} + threadIdx.x; p < {lead.par_size}; "
            f"p += ({ity})gridDim.x * {block}) {{",
            *_indent(decl + ones + body.init + inner + body.final, 1),
            "}",
        ]
        name = f"ocannl_{strategy}"
        src = "\n".join([_signature(name, nodes, [], block), *_indent(lines, 1), "}"])
        self.steps.append(Kernel(strategy, name, src + "\n", grid, block, tuple(nodes)))

    def reduce(self, a: Accum, nodes: list[Tnode], f: CudaFlavour, names: dict[int, str],
               par: list[int], red: list[int], body: NestBody, split: tuple[int, int],
               launch: tuple[int, int]) -> None:
        """A block of threads per cell (``launch``: scheduling's grid and block), each cell's
        terms in ``split`` chunks; more than one: a partial pass, then a final one combining
        the partials in chunk order."""
        par_size = math.prod(a.space[i] for i in par)
        red_size = math.prod(a.space[i] for i in red)
        compute = a.lhs.prec.compute
        acc_type = _CTYPE[compute]
        splits, chunk = split
        ity = _index_type(math.prod(a.space), par_size * splits, *(n.size for n in nodes))
        grid, block = launch
        combine = _block_reduce(f, a.accum, acc_type, block)
        prologue = [
            f"__shared__ {acc_type} sh[{block // WARP}];",
            "const int lane = threadIdx.x & 31;",
            "const int warp = threadIdx.x >> 5;",
        ]
        inner_text = "\n".join(body.inner)
        red_decl = _decompose("r", red, a.space, names, ity, inner_text)
        if splits == 1:
            text = "\n".join(body.init + body.inner + body.final)
            loop = [
                f"for ({ity} p = blockIdx.x; p < {par_size}; p += gridDim.x) {{",
                *_indent(_decompose("p", par, a.space, names, ity, text), 1),
                *_indent(body.init, 1),
                f"  for ({ity} r = threadIdx.x; r < {red_size}; r += {block}) {{",
                *_indent(red_decl + body.inner, 2),
                "  }",
                *_indent(combine, 1),
                "  if (threadIdx.x == 0) {",
                *_indent(body.final, 2),
                "  }",
                "  __syncthreads();",
                "}",
            ]
            src = "\n".join([_signature("ocannl_reduce", nodes, [], block),
                             *_indent(prologue + loop, 1), "}"])
            self.steps.append(Kernel("reduce", "ocannl_reduce", src + "\n", grid, block,
                                     tuple(nodes)))
            return
        part = self.slot(par_size * splits, compute)
        total = par_size * splits
        text = "\n".join(body.init + body.inner)
        loop = [
            f"for ({ity} q = blockIdx.x; q < {total}; q += gridDim.x) {{",
            f"  const {ity} p = q / {splits};",
            f"  const {ity} lo = (q - p * {splits}) * {chunk};",
            f"  const {ity} hi = min(lo + {chunk}, ({ity}){red_size});",
            *_indent(_decompose("p", par, a.space, names, ity, text), 1),
            *_indent(body.init, 1),
            f"  for ({ity} r = lo + threadIdx.x; r < hi; r += {block}) {{",
            *_indent(red_decl + body.inner, 2),
            "  }",
            *_indent(combine, 1),
            "  if (threadIdx.x == 0) s0[q] = acc;",
            "  __syncthreads();",
            "}",
        ]
        src = "\n".join([_signature("ocannl_partial", nodes, [part], block),
                         *_indent(prologue + loop, 1), "}"])
        self.steps.append(Kernel("partial", "ocannl_partial", src + "\n", grid, block,
                                 tuple(nodes), (part,)))
        # The final pass touches only the lhs (b0: an assignment's first node) and the
        # partials; the body's init and final statements mention nothing else.
        assert nodes[0] is a.lhs
        text = "\n".join(body.final)
        loop = [
            f"for ({ity} p = blockIdx.x; p < {par_size}; p += gridDim.x) {{",
            *_indent(_decompose("p", par, a.space, names, ity, text), 1),
            *_indent(body.init, 1),
            f"  for ({ity} s = threadIdx.x; s < {splits}; s += {block}) {{",
            f"    const {acc_type} other = s0[p * {splits} + s];",
            f"    acc = {core.combine(f, a.accum, 'acc', 'other', compute)};",
            "  }",
            *_indent(combine, 1),
            "  if (threadIdx.x == 0) {",
            *_indent(body.final, 2),
            "  }",
            "  __syncthreads();",
            "}",
        ]
        src = "\n".join([_signature("ocannl_final", [a.lhs], [part], block),
                         *_indent(prologue + loop, 1), "}"])
        self.steps.append(Kernel("final", "ocannl_final", src + "\n", min(par_size, MAX_GRID),
                                 block, (a.lhs,), (part,)))


# The 16-bit precisions cuBLAS multiplies as stored (gemmEx, f32 accumulation into f32).
NATIVE_PRODUCTS = frozenset({Precision.f16, Precision.bf16})


def cuda_target(cublas: bool = True, *, fma: bool = True, tf32: bool = False) -> Target:
    """What lowering may rely on for this backend: cuBLAS products when it is loadable, batched
    ones (attention's per-head products) as strided-batched calls, convolutions through patches
    and a product where lowering finds it worth it (``im2col``: the patch nests are ordinary
    loop groups), f16 and bf16 operands taken as stored (``NATIVE_PRODUCTS``), never inline
    (products cuBLAS does not take run as generated kernels); no thread pool (threads are the
    kernels' own), f16 conversions in hardware; ``fma``: NVRTC may contract multiply-adds
    (``--fmad``); ``tf32``: f32 products may round their operands to TF32."""
    fma, tf32 = require_bool("cuda_target: fma", fma), require_bool("cuda_target: tf32", tf32)
    return Target(name="cuda", gemm=cublas, batched_gemm=cublas, im2col=cublas,
                  native_products=NATIVE_PRODUCTS if cublas else frozenset(),
                  inline_product_work=0, inline_native_work=0, threads=1,
                  products_shared=False, parallel_scatters=False, hardware_f16=True,
                  gpu_block=BLOCK, gpu_sms=SMS, fma=fma, tf32=tf32)


def plan_routine(code: Sequence[Lowered]) -> Plan:
    """The launch plan of lowered code, one step per lowered item (a split reduction takes two
    passes): pure Python, no GPU needed. The plan renders what lowering decided for
    :func:`cuda_target`."""
    p = _Planner()
    for item in code:
        if isinstance(item, Fill):
            p.fill(item)
        elif isinstance(item, Gemm):
            p.gemm(item)
        else:
            p.group(item)
    steps = tuple(replace(s, source=_with_includes(s.source)) if isinstance(s, Kernel) else s
                  for s in p.steps)
    return Plan(steps, tuple(p.scratch))


def cuda_sources(comp: Comp | Sequence[Lowered], *, use_cublas: bool = True) -> list[str]:
    """The CUDA C source of every distinct kernel of a computation (or of lowered code), as
    the CUDA backend would compile them; needs no GPU, so NVRTC can check them anywhere."""
    code = lower(comp, cuda_target(use_cublas)) if isinstance(comp, Comp) else list(comp)
    return plan_routine(code).sources()


