"""Matmul kernels for the CPU: the small bf16 matmul (small_bf16.py, small_bf16.cc) for decode
steps and small prefill chunks."""
