"""Libraries loaded as one private group (``ocannl/backends/cpu/link_group.py``)."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import pytest

from ocannl.backends.cpu import link_group

pytestmark = pytest.mark.skipif(not link_group.supported(), reason="Linux on x86-64 only")


def _libm() -> Path:
    """libm's file: the loader resolves the group's entries by absolute path."""
    name = ctypes.util.find_library("m") or "libm.so.6"
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
        if (Path(folder) / name).exists():
            return Path(folder) / name
    pytest.fail(f"{name} not found in the usual folders")


def test_a_group_is_loaded_and_its_symbols_are_reached_through_its_handle():
    group = link_group.load([_libm()], "ocannl_test_group")
    cos = group.cos
    cos.restype, cos.argtypes = ctypes.c_double, [ctypes.c_double]
    assert cos(0.0) == 1.0


def test_a_missing_library_is_refused_naming_it(tmp_path):
    missing = tmp_path / "libnothing.so"
    with pytest.raises(OSError, match="libnothing.so"):
        link_group.load([missing], "ocannl_test_missing")


def test_the_stub_names_each_library_and_its_own_soname():
    stub = link_group.needing(["/a/liba.so.1", "/b/libb.so.2"], "libstub.so")
    assert stub[:4] == b"\x7fELF" and stub[16] == 3  # a shared object
    for name in (b"/a/liba.so.1\0", b"/b/libb.so.2\0", b"libstub.so\0"):
        assert name in stub


def test_each_group_is_a_library_of_its_own():
    """The loader knows a group by its path (``/proc/self/fd/N``): were the descriptor closed,
    the next group would get its number, and the loader would hand back the first group."""
    first = link_group.load([_libm()], "ocannl_test_first")
    second = link_group.load([_libm()], "ocannl_test_second")
    assert first._handle != second._handle
