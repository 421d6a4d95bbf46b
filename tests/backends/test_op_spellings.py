"""Each backend spells every op of the op table, and only those: the CPU renderer's LLVM IR
builders (``ocannl.backends.cpu.op_builders.BUILDERS``) and the C templates of the CUDA kernels
(``ocannl.backends.emit.C_TEMPLATES``, what ``CudaFlavour`` renders with) are keyed by the op
table's row names; the op table itself (``ocannl.ir.ops``) imports no backend."""

from __future__ import annotations

import grimp

from ocannl.backends.cpu.op_builders import BUILDERS
from ocannl.backends.cuda.plan import CudaFlavour
from ocannl.backends.emit import C_TEMPLATES
from ocannl.ir.ops import OPS


def test_every_row_has_its_builder_on_the_cpu_backend():
    assert set(OPS) - set(BUILDERS) == set(), "rows without an LLVM builder"
    assert set(BUILDERS) - set(OPS) == set(), "builders of ops the op table lacks"
    assert all(callable(BUILDERS[name]) for name in OPS)


def test_every_row_has_its_spelling_on_the_cuda_backend():
    assert CudaFlavour.templates is C_TEMPLATES
    assert set(OPS) - set(C_TEMPLATES) == set(), "rows without a C template"
    assert set(C_TEMPLATES) - set(OPS) == set(), "templates of ops the op table lacks"


def test_the_ir_imports_no_backend():
    graph = grimp.build_graph("ocannl", exclude_type_checking_imports=True)
    reached = [(m, e) for m in graph.modules if m.startswith("ocannl.ir")
               for e in graph.find_modules_directly_imported_by(m)
               if e.startswith("ocannl.backends")]
    assert reached == []
