"""Ragged paged attention: one signature (reference.py), three implementations: the jnp
reference (any device), the Pallas/Triton kernel (kernel.py, GPU) and the C++ CPU kernel (cpu.py,
cpu_attention.cc)."""
from pallas_kernels.attention.reference import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention_reference"]
