"""Backends: ``base`` (the protocol a Context drives), ``emit`` (C emission for CUDA kernels),
``cpu`` (LLVM through llvmlite) and ``cuda`` (CuPy)."""
