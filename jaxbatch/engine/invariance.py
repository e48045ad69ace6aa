"""Batch-invariant numerics (`batch_invariant: true`, `--batch-invariant`; on by default for
`jaxbatch batch`): a request gives the same tokens alone or in any batch, in any bucket, at any
row of its step, with prefix caching on or off and at any prefill chunking, because every number
of a row is computed by a sequence of operations fixed by that row's own data.

What each part of the step does for it:
- linear layers and the head with bf16 weights: every step, whatever its token count, runs the
  small bf16 matmul (pallas_kernels/matmul/small_bf16.cc: one f32 accumulator per output, K in
  order, for any M) instead of XLA's dot above the measured cut-over (engine/precision.py):
  XLA:CPU's dot blocks and orders K by the shape of the call.
- GGUF and int8 weights: the quantised matmul (quant.cc) is invariant by construction, mode or
  not.
- the head's logits stay float32 (always, mode or not).
- attention (the CPU kernel, pallas_kernels/attention/cpu_attention.cc): keys in 512-key splits
  from position 0 for every query row.
- norms, rope, activations, the sampler: per-row XLA ops; the sampler's random stream is keyed by
  (seed, output index) and its top-k / top-p cut does not depend on the other rows
  (engine/sampler.py).
tests/engine/test_batch_invariance.py checks the whole step on bench64.
"""

from __future__ import annotations

ALL_ROWS = 1 << 30  # "every step": the small matmul's row limit when invariance is on


def invariant_matmul_rows(dtype: str, sharded: bool, float_linears: bool) -> int:
    """The small bf16 matmul's row limit for a batch-invariant engine (every step), or 0 where
    no float weight needs it; a clear error where the mode cannot hold."""
    import jax

    from pallas_kernels.matmul import small_bf16

    if jax.default_backend() != "cpu":
        raise ValueError(f"batch_invariant runs on CPU only (this backend: "
                         f"{jax.default_backend()})")
    if sharded:
        raise ValueError("batch_invariant does not run with tensor parallelism yet")
    if dtype == "bfloat16" and float_linears:
        if not small_bf16.available():
            raise ValueError("batch_invariant with bfloat16 weights needs the small bf16 matmul "
                             "(a CPU with AVX512-BF16 and the C++ kernel library built)")
        return ALL_ROWS
    return 0
