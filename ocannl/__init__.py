"""ocannl: a Python port of the core of OCANNL.

Models are graphs of tensors (``ocannl.tensor``); their forward and backward code is generated
as assignments (``ocannl.ir``) that a ``Context`` compiles into routines on a backend
(``ocannl.backends``: LLVM on the CPU, CuPy on CUDA GPUs).
"""

from ocannl.context import Context, Routine
from ocannl.errors import Failure
from ocannl.ir.ops import Precision
from ocannl.tensor import Tensor, set_seed

__all__ = ["Context", "Failure", "Precision", "Routine", "Tensor", "set_seed"]
