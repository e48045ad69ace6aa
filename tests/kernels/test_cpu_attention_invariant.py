"""The CPU attention kernel's batch-invariant mode (`invariant=True`, tuning/invariance.py): a
query row's output bits do not depend on how its step ran it: alone as a decode row, in a prefill
chunk of any length and start, split into items of any size, or beside other sequences. Checked
bitwise on a bf16 cache (the engine's bf16 model), with pages of 16 (a 16-key block read in
place from its page), 1 and 24 (blocks gathered across pages), at head dims 64 and 128; and with
a sliding window, a soft cap and sinks at head dim 80 (a run-time head dim: the f32 path's fixed
order at every level). Each level runs its own paths: AMX tiles or AVX512-BF16 at native, the f32
path's fixed order at avx2 (JAXBATCH_CPU_LEVEL=avx2).

Without `invariant` the same comparisons are not expected to hold (decode rows and prefill items
take different summation orders), which a test shows so that the first cannot pass vacuously;
and since equal bits could still be wrong ones, the mode's rows are checked against the exact
(float64) attention of the same values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.attention import cpu as cpu_kernel
from tests.helpers.attention_cases import make_batch, naive_attention

HQ, HKV = 9, 3
KEYS = 700  # one sequence's keys: two 512-key splits for the last rows


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory):
    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    assert why is None, why  # the CI machine has a compiler: a failed build is a failure
    if not cpu_library.has("attention_invariant"):  # a build without AVX2 and FMA (aarch64)
        pytest.skip("this kernel build has no invariant attention mode (needs AVX2 and FMA)")


@functools.partial(jax.jit, static_argnames=("invariant", "q_block", "window", "soft_cap"))
def _attend(q, k, v, kv_lens, pages, cu, num_seqs, sinks, invariant, q_block, window=None,
            soft_cap=None):
    return cpu_kernel.ragged_paged_attention_cpu(q, k, v, kv_lens, pages, cu, num_seqs,
                                                 sm_scale=0.125, invariant=invariant,
                                                 q_block=q_block, sliding_window=window,
                                                 soft_cap=soft_cap, sinks=sinks)


class Sequence:
    """KEYS keys of one sequence in scattered pages of `page_size` (a bf16 cache as uint16
    bits), every position's query, and another sequence's data to share a step with."""

    def __init__(self, page_size: int, head_dim: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.P, self.D = page_size, head_dim
        n_pages = -(-KEYS // page_size)
        self.num_pages = 2 * n_pages + 1
        bits = lambda shape: jnp.asarray(  # noqa: E731  # bf16 bits of N(0, 1) values
            np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16).view(jnp.uint16)))
        self.k = bits((self.num_pages, page_size, HKV, head_dim))
        self.v = bits((self.num_pages, page_size, HKV, head_dim))
        order = rng.permutation(np.arange(1, self.num_pages))
        self.table = np.zeros((2, 2 * n_pages), np.int32)
        self.table[0, :n_pages] = order[:n_pages]  # this sequence
        self.table[1, :n_pages] = order[n_pages:2 * n_pages]  # a neighbour
        self.q = jnp.asarray(rng.standard_normal((KEYS, HQ, head_dim)), jnp.bfloat16)
        self.q_other = jnp.asarray(rng.standard_normal((KEYS, HQ, head_dim)), jnp.bfloat16)

    def rows(self, start: int, end: int, invariant: bool = True, q_block: int = 16,
             neighbour: tuple[int, int] | None = None, **kw) -> np.ndarray:
        """Output rows [start, end) of the sequence computed as one chunk (kv_len = end), after
        the neighbour's chunk (its rows [a, b)) when given: [end - start, HQ, D] float32.
        `kw`: window, soft_cap, sinks ([HQ] f32)."""
        sinks = kw.pop("sinks", None)
        qs, lens, cu, tables = [], [], [0], []
        if neighbour is not None:
            a, b = neighbour
            qs.append(self.q_other[a:b])
            lens.append(b)
            cu.append(b - a)
            tables.append(self.table[1])
        qs.append(self.q[start:end])
        lens.append(end)
        cu.append(cu[-1] + end - start)
        tables.append(self.table[0])
        out = _attend(jnp.concatenate(qs), self.k, self.v, jnp.asarray(lens, jnp.int32),
                      jnp.asarray(np.stack(tables)), jnp.asarray(cu, jnp.int32),
                      jnp.array([len(lens)], jnp.int32), sinks, invariant=invariant,
                      q_block=q_block, **kw)
        return np.asarray(out[cu[-2]:cu[-1]].astype(jnp.float32))


@pytest.mark.parametrize("page_size", [16, 1, 24])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_row_has_one_result_however_its_step_runs_it(page_size, head_dim):
    seq = Sequence(page_size, head_dim)
    want = seq.rows(540, KEYS)  # one prefill chunk of 160 rows after 540 cached keys
    assert np.isfinite(want).all()
    ways = {
        "items of 1 row": seq.rows(540, KEYS, q_block=1),
        "items of 5 rows": seq.rows(540, KEYS, q_block=5),
        "chunks of 37": np.concatenate([seq.rows(s, min(s + 37, KEYS))
                                        for s in range(540, KEYS, 37)]),
        "beside a 300-row prefill": seq.rows(540, KEYS, neighbour=(0, 300)),
    }
    for name, got in ways.items():
        assert np.array_equal(got, want), f"{name}: rows differ from the one-chunk result"
    for pos in (540, 541, 600, 699):  # decode rows, alone and beside another sequence's rows
        assert np.array_equal(seq.rows(pos, pos + 1)[0], want[pos - 540]), pos
        assert np.array_equal(seq.rows(pos, pos + 1, neighbour=(10, 11))[0], want[pos - 540])
        assert np.array_equal(seq.rows(pos, pos + 1, neighbour=(0, 200))[0], want[pos - 540])
    # a fresh prompt's rows (one split, starting at key 0) the same way
    first = seq.rows(0, 200)
    assert np.array_equal(np.concatenate([seq.rows(s, s + 8) for s in range(0, 200, 8)]), first)
    assert np.array_equal(seq.rows(99, 100)[0], first[99])


SINKS = jnp.asarray([0.0, 1.5, -2.0, 4.0, -4.0, 3.0, 0.5, -0.5, 2.0], jnp.float32)  # HQ = 9


def test_window_soft_cap_and_sinks_at_a_run_time_head_dim():
    """A sliding window (an item's first key then depends on its first row: the keys before a
    row's window weigh exactly nothing), a soft cap and sinks, at head dim 80 (not a compiled
    size: 10 chunks of 8 floats, the f32 path at every level)."""
    seq = Sequence(16, 80, seed=1)
    kw = {"window": 100, "soft_cap": 30.0, "sinks": SINKS}
    want = seq.rows(540, KEYS, **kw)
    assert np.isfinite(want).all()
    assert np.array_equal(seq.rows(540, KEYS, q_block=3, **kw), want)
    assert np.array_equal(seq.rows(540, KEYS, neighbour=(0, 120), **kw), want)
    assert np.array_equal(np.concatenate([seq.rows(s, min(s + 50, KEYS), **kw)
                                          for s in range(540, KEYS, 50)]), want)
    for pos in (540, 611, 699):
        assert np.array_equal(seq.rows(pos, pos + 1, **kw)[0], want[pos - 540]), pos


@pytest.mark.parametrize("head_dim", [64, 80])
def test_the_mode_computes_attention(head_dim):
    """Equal bits could be equally wrong: the mode's rows (decode rows, prefill chunks over one
    and two splits; window, soft cap, sinks) against the float64 attention of the same bf16
    values, within the kernel tests' bf16 tolerance (test_cpu_kernel.TOL)."""
    q_lens, ctx = [1, 130, 1, 17, 1, 300], [700, 0, 33, 600, 0, 400]
    args, host = make_batch(7, q_lens, ctx, num_q_heads=HQ, num_kv_heads=HKV,
                            head_dim=head_dim, page_size=16, dtype=jnp.bfloat16)
    q, k, v, *rest = args
    k, v = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k, v))  # the engine's cache
    for kw in ({}, {"window": 128, "soft_cap": 20.0, "sinks": SINKS}):
        got = np.asarray(_attend(q, k, v, *rest, kw.get("sinks"), invariant=True, q_block=16,
                                 window=kw.get("window"), soft_cap=kw.get("soft_cap"))
                         .astype(jnp.float32))
        want = naive_attention(host, sm_scale=0.125, soft_cap=kw.get("soft_cap"),
                               sliding_window=kw.get("window"), sinks=kw.get("sinks"))
        np.testing.assert_allclose(got, want, atol=1.5e-2, rtol=1.5e-2)


def test_without_the_mode_decode_rows_and_prefill_chunks_differ():
    """On an AVX-512 build the default mode's decode rows and prefill items sum in different
    orders: the invariant test above compares results that could differ. An AVX2 build's
    default takes the fixed-order sums for every item (they are its faster ones), so there its
    rows agree without the mode too; its softmax's exp is not torch's unless the mode is on."""
    seq = Sequence(16, 64)
    chunk = seq.rows(540, KEYS, invariant=False)
    alone = np.stack([seq.rows(p, p + 1, invariant=False)[0] for p in range(540, 600)])
    avx2_build = cpu_library.levels() is cpu_library.X86_LEVELS and (
        cpu_library.cpu_level() == "avx2" or not cpu_library.cpu_has("avx512f"))
    assert np.array_equal(alone, chunk[:60]) == avx2_build
