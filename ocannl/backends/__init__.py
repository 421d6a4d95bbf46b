"""Backends: ``base`` (the protocol a Context drives), ``emit`` (C-like emission shared by every
backend), ``cpu`` (Numba) and ``cuda`` (CuPy)."""
