"""The CPU ragged paged attention kernel (cpu_attention.cc), called with reference.py's
signature; built and registered as an XLA FFI custom call by pallas_kernels/cpu_library.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library
from pallas_kernels.cpu_library import KernelUnavailable

TARGET = "jaxbatch_ragged_paged_attention"
KV_SPLIT = 512  # keys per softmax split: torch's CPU flash attention's (see cpu_attention.cc)
Q_BLOCK = 16  # query rows per work item of a prefill chunk


def ragged_paged_attention_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
    kv_split: int = KV_SPLIT,
    q_block: int = Q_BLOCK,
    use_amx: bool = True,
    invariant: bool = False,
) -> jax.Array:
    """reference.py's signature and result (up to f32 summation order); `register` first.
    With a bf16 cache (bf16, or uint16 bits) the probabilities are rounded to bf16 before the
    PV product, as torch's CPU flash attention does. bf16 queries and cache: decode rows use
    AVX512-BF16 dots on the pages in place, prefill rows AMX tiles, where the CPU has them;
    without AMX, prefill items run the bf16 path in GEMM-like blocks (K gathered transposed,
    V and probabilities packed in pairs) (`use_amx=False`: the f32 path for prefill rows, for
    tests to compare). `invariant`: every bf16 row on one path whatever its item (AMX tiles,
    or the decode rows' path; without AVX512-BF16 the f32 path with each row's sums in one
    fixed order): one summation order for a query row whatever its chunk, the engine's
    batch-invariant mode.
    `sinks` f32 [Hq]: each head's sink logit in the softmax denominator (gpt-oss), applied
    where each row is normalised; absent, the kernel gets an empty array and runs as before.
    Metadata that does not fit the buffers (a page id outside the cache, a kv_len past its page
    table row, cu_q_lens out of order, num_seqs past the arrays) fails the call with a
    ValueError naming the field (cpu_attention.cc check_metadata), never a read outside them."""
    if not cpu_library.registered():
        raise KernelUnavailable("cpu_library.register(cache_dir) first")
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else \
        jnp.asarray(sinks, jnp.float32).reshape(q.shape[1])
    round_p = k_pages.dtype in (jnp.uint16, jnp.bfloat16)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype),
                            vmap_method="sequential")
    return call(q, k_pages, v_pages, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32),
                cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32), window.reshape(1), sinks,
                sm_scale=np.float32(sm_scale),
                soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
                kv_split=np.int64(kv_split), round_p=bool(round_p), q_block=np.int64(q_block),
                use_amx=bool(use_amx), invariant=bool(invariant))
