"""Load shared libraries as one group, private to this project: resolved against each other as a
program linked with all of them would be, and none of their symbols added to the process's
global scope.

Why: MKL's pip wheel comes as libraries meant for one link line (interface, threading layer,
core); its single dynamic library ``libmkl_rt`` loads them with ``RTLD_GLOBAL``. PyTorch's CPU
wheel carries its own MKL, linked into ``libtorch_cpu`` with every symbol exported, so once our
MKL's symbols are global, PyTorch's calls bind to them: another MKL version's internals, on
our sequential layer (measured: its 256x1024 by 1024x1024 product went from 2.3 to 4.0 ms).
Loaded here, the group is seen only through the handle this module returns.

How: a shared object made in memory (a ``memfd``) holding nothing but ``DT_NEEDED`` entries,
one per library, opened with ``RTLD_LOCAL``: the loader puts its dependencies in one search
list, local to it, where each finds the others' symbols.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from pathlib import Path

# ELF constants (the System V ABI, x86-64 supplement).
_ET_DYN, _EM_X86_64 = 3, 62
_PT_LOAD, _PT_DYNAMIC, _PT_GNU_STACK = 1, 2, 0x6474E551
_PF_RW = 6
_DT_NULL, _DT_NEEDED, _DT_HASH, _DT_STRTAB, _DT_SYMTAB = 0, 1, 4, 5, 6
_DT_STRSZ, _DT_SYMENT, _DT_SONAME = 10, 11, 14
_EHDR, _PHDR, _SYM = 64, 56, 24


def supported() -> bool:
    """Whether this machine loads such a group: Linux on x86-64."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and hasattr(os, "memfd_create"))


def load(paths: list[Path], name: str) -> ctypes.CDLL:
    """The libraries at ``paths`` (in link order) loaded as one local group; symbols are
    looked up through the returned handle. ``OSError`` when the loader refuses them."""
    if not supported():
        raise OSError(f"loading a library group needs Linux on x86-64, not "
                      f"{platform.system()} on {platform.machine()}")
    fd = os.memfd_create(name)
    try:
        os.write(fd, needing([str(p) for p in paths], f"lib{name}.so"))
        return ctypes.CDLL(f"/proc/self/fd/{fd}", mode=os.RTLD_LOCAL)
    except OSError:
        os.close(fd)
        raise
    # On success the descriptor stays open, as the group stays loaded: the loader knows the
    # group by its path, and a closed descriptor's number, given to the next group, would
    # name this one (the loader would return its handle).


def needing(needed: list[str], soname: str) -> bytes:
    """An x86-64 ELF shared object with no code and no symbols, whose dynamic section names
    ``needed`` (absolute paths: found without a search path) and ``soname``: one writable
    segment (the loader adjusts the dynamic section in place), the dynamic section, and a
    non-executable stack (without that note, the loader would make the stack executable, or
    refuse)."""
    strtab = b"\0"
    offsets = []
    for text in (*needed, soname):
        offsets.append(len(strtab))
        strtab += text.encode() + b"\0"
    n_phdr = 3
    symtab = _EHDR + n_phdr * _PHDR  # one null symbol
    hashtab = symtab + _SYM  # one bucket, one chain, both empty
    strings = hashtab + 16
    dynamic = (strings + len(strtab) + 7) & ~7
    entries = [(_DT_NEEDED, off) for off in offsets[:-1]] + [
        (_DT_SONAME, offsets[-1]), (_DT_HASH, hashtab), (_DT_STRTAB, strings),
        (_DT_SYMTAB, symtab), (_DT_STRSZ, len(strtab)), (_DT_SYMENT, _SYM), (_DT_NULL, 0)]
    size = dynamic + 16 * len(entries)
    out = bytearray(size)
    struct.pack_into("<4sBBBBB7xHHIQQQIHHHHHH", out, 0, b"\x7fELF", 2, 1, 1, 0, 0, _ET_DYN,
                     _EM_X86_64, 1, 0, _EHDR, 0, 0, _EHDR, _PHDR, n_phdr, 64, 0, 0)
    segments = [(_PT_LOAD, _PF_RW, 0, 0, 0, size, size, 0x1000),
                (_PT_DYNAMIC, _PF_RW, dynamic, dynamic, dynamic, 16 * len(entries),
                 16 * len(entries), 8),
                (_PT_GNU_STACK, _PF_RW, 0, 0, 0, 0, 0, 16)]
    for k, segment in enumerate(segments):
        struct.pack_into("<IIQQQQQQ", out, _EHDR + k * _PHDR, *segment)
    struct.pack_into("<IIII", out, hashtab, 1, 1, 0, 0)
    out[strings:strings + len(strtab)] = strtab
    for k, entry in enumerate(entries):
        struct.pack_into("<qQ", out, dynamic + 16 * k, *entry)
    return bytes(out)
