"""The CUDA backend: ``plan`` turns lowered code into kernels and cuBLAS calls (pure Python, no
GPU needed), ``runtime`` runs plans through CuPy, ``nvrtc`` compiles sources without a GPU."""
