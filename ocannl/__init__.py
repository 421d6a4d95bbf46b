"""ocannl: a Python port of the core of OCANNL.

Models are graphs of tensors (``ocannl.tensor``); their forward and backward code is generated
as assignments (``ocannl.ir``) that a ``Context`` compiles into routines on a backend
(``ocannl.backends``: Numba on the CPU, CuPy on CUDA GPUs).
"""


class Failure(ValueError):
    """OCaml's ``Failure``: an operation could not be carried out on well-typed input."""


from ocannl.context import Context, Routine  # noqa: E402
from ocannl.ir.ops import Precision  # noqa: E402
from ocannl.tensor import Tensor, set_seed  # noqa: E402

__all__ = ["Context", "Failure", "Precision", "Routine", "Tensor", "set_seed"]
