"""Attention kernels with a shared signature: a pure-jnp reference (CPU path) and Pallas GPU kernels."""
