"""The CPU backend: loop nests rendered as Numba-compiled Python over flat NumPy buffers."""
