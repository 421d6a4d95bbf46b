"""The CPU backend: loop nests compiled to machine code through LLVM IR, over flat NumPy
buffers."""
