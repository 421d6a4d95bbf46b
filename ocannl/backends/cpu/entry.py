"""A bound routine as a Python builtin function, for the every-step call.

Calling compiled code through ctypes costs about 0.45 us a call here (a closure's frame, the
conversion of the table's address, libffi); a step of a small model runs one or two routines
of 5-10 us each. A builtin function made over a small compiled trampoline costs about 0.13 us.
The trampoline releases the GIL around the routine, as ctypes does, so other Python threads
run meanwhile.

The builtin's ``self`` is a :class:`Bound`: an ``int`` holding the address of three words (the
routine's entry, its table of buffer addresses, ``None``), which also keeps the buffers, the
table and those words alive while the builtin lives. A gated pair (the host gate's step: a
routine, then a second one only when an f32 the first wrote is finite) is one such builtin
over seven words, returning whether the second ran: one call where there were two and a read.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

TRAMPOLINE = "ocannl_entry"
GATED = "ocannl_gated_entry"
C_API = ("PyEval_SaveThread", "PyEval_RestoreThread", "PyLong_AsVoidPtr", "Py_IncRef")
_METH_NOARGS = 0x0004


def module_ir() -> str:
    """``PyObject *ocannl_entry(PyObject *self, PyObject *unused)``: read the three words at
    ``PyLong_AsVoidPtr(self)``, call ``entry(table)`` with the GIL released, return ``None``
    (a new reference). ``ocannl_gated_entry``: seven words (two routines' entries and tables,
    an f32's address, ``True``, ``False``): run the first routine, the second only when the
    f32 is then finite (``x - x == 0``), both with the GIL released; return whether it was."""
    return f"""
declare i8* @PyEval_SaveThread()
declare void @PyEval_RestoreThread(i8*)
declare i8* @PyLong_AsVoidPtr(i8*)
declare void @Py_IncRef(i8*)

define i8* @{TRAMPOLINE}(i8* %self, i8* %unused) {{
  %raw = call i8* @PyLong_AsVoidPtr(i8* %self)
  %words = bitcast i8* %raw to i64*
  %entry_word = load i64, i64* %words
  %table_at = getelementptr i64, i64* %words, i64 1
  %table_word = load i64, i64* %table_at
  %none_at = getelementptr i64, i64* %words, i64 2
  %none_word = load i64, i64* %none_at
  %entry = inttoptr i64 %entry_word to void (i64*)*
  %table = inttoptr i64 %table_word to i64*
  %state = call i8* @PyEval_SaveThread()
  call void %entry(i64* %table)
  call void @PyEval_RestoreThread(i8* %state)
  %none = inttoptr i64 %none_word to i8*
  call void @Py_IncRef(i8* %none)
  ret i8* %none
}}

define i8* @{GATED}(i8* %self, i8* %unused) {{
  %raw = call i8* @PyLong_AsVoidPtr(i8* %self)
  %words = bitcast i8* %raw to i64*
  %first = call i64 @ocannl_word(i64* %words, i64 0)
  %first_table = call i64 @ocannl_word(i64* %words, i64 1)
  %second = call i64 @ocannl_word(i64* %words, i64 2)
  %second_table = call i64 @ocannl_word(i64* %words, i64 3)
  %flag_word = call i64 @ocannl_word(i64* %words, i64 4)
  %state = call i8* @PyEval_SaveThread()
  call void @ocannl_run(i64 %first, i64 %first_table)
  %flag = inttoptr i64 %flag_word to float*
  %value = load volatile float, float* %flag
  %less = fsub float %value, %value
  %finite = fcmp oeq float %less, 0.0
  br i1 %finite, label %then, label %done
then:
  call void @ocannl_run(i64 %second, i64 %second_table)
  br label %done
done:
  call void @PyEval_RestoreThread(i8* %state)
  %answer_at = select i1 %finite, i64 5, i64 6
  %answer_word = call i64 @ocannl_word(i64* %words, i64 %answer_at)
  %answer = inttoptr i64 %answer_word to i8*
  call void @Py_IncRef(i8* %answer)
  ret i8* %answer
}}

define internal i64 @ocannl_word(i64* %words, i64 %k) alwaysinline {{
  %at = getelementptr i64, i64* %words, i64 %k
  %word = load i64, i64* %at
  ret i64 %word
}}

define internal void @ocannl_run(i64 %entry_word, i64 %table_word) alwaysinline {{
  %entry = inttoptr i64 %entry_word to void (i64*)*
  %table = inttoptr i64 %table_word to i64*
  call void %entry(i64* %table)
  ret void
}}
"""


def c_api_symbols() -> dict[str, int]:
    """The addresses of the C API functions the trampoline calls, for the JIT's linker."""
    return {name: ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value or 0
            for name in C_API}


class Bound(int):
    """The builtin's ``self``: the address of the words it reads; ``keep_alive`` holds what
    those words point into."""

    keep_alive: tuple


class _MethodDef(ctypes.Structure):
    _fields_ = [("ml_name", ctypes.c_char_p), ("ml_meth", ctypes.c_void_p),
                ("ml_flags", ctypes.c_int), ("ml_doc", ctypes.c_char_p)]


_new_builtin = ctypes.pythonapi.PyCFunction_NewEx
_new_builtin.restype = ctypes.py_object
_new_builtin.argtypes = [ctypes.c_void_p, ctypes.py_object, ctypes.py_object]
_methods: dict[int, _MethodDef] = {}  # one per trampoline address


def _immortal(method: _MethodDef) -> _MethodDef:
    """``method`` with a reference nothing ever drops. Every builtin reads its method record
    when it is freed, and at interpreter exit this module's dict (``_methods``) is cleared
    before the last garbage collection frees a program's routines (a routine and its context
    refer to each other): their record would be freed memory, reused by then, and a stray flag
    there makes the builtin's deallocation follow a wild pointer (a crash after the program's
    last line)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(method))
    return method


def builtin(trampoline: int, entry: int, table: np.ndarray, keep_alive: tuple
            ) -> Callable[[], None]:
    """A builtin function that runs the routine at ``entry`` on ``table`` (an int64 array of
    buffer addresses), through the trampoline at ``trampoline``."""
    return _bound(trampoline, [entry, table.ctypes.data, id(None)], (table, keep_alive))


def gated_builtin(trampoline: int, first: tuple[int, np.ndarray], second: tuple[int, np.ndarray],
                  flag: int, keep_alive: tuple) -> Callable[[], bool]:
    """A builtin function that runs the routine ``first`` (its entry and table), then
    ``second`` only when the f32 at address ``flag`` is finite, and returns whether it was:
    through the trampoline at ``trampoline`` (``ocannl_gated_entry``)."""
    (e1, t1), (e2, t2) = first, second
    words = [e1, t1.ctypes.data, e2, t2.ctypes.data, flag, id(True), id(False)]
    return _bound(trampoline, words, (t1, t2, keep_alive))


def _bound(trampoline: int, words: list[int], keep_alive: tuple) -> Callable[[], object]:
    """The builtin calling ``trampoline`` with a :class:`Bound` over ``words``."""
    method = _methods.get(trampoline)
    if method is None:
        method = _methods[trampoline] = _immortal(_MethodDef(
            b"routine", trampoline, _METH_NOARGS, b"Run the routine on its bound buffers."))
    held = np.array(words, dtype=np.int64)
    bound = Bound(held.ctypes.data)
    bound.keep_alive = (held, keep_alive)
    return _new_builtin(ctypes.addressof(method), bound, None)
