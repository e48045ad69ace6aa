"""The gated delta rule's forms (model/archs/deltanet.py: the token-by-token spec and the chunked
WY form) against a float64 token-by-token reference on random ragged steps: sequences of many
chunks, of one token, of none, fresh and continuing from a carried state, padding tokens and
padding sequences; and a sequence cut into steps at arbitrary points equals the uncut one.

Bound: REL of the largest |reference| value, on the outputs and on the states after the step.
Measured (f32 on both forms, 4 value heads of 32 x 16): token form 2e-7, chunked 1.1e-6 (sums
over a 64-token chunk and a 16-row block solve); the bound leaves ~10x room.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbatch.model.archs import deltanet

REL = 1e-5
HK, HV, DK, DV = 2, 4, 32, 16


def l2(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def draw(rng: np.random.Generator, T: int, S: int, hk: int = HK, hv: int = HV, dk: int = DK,
         dv: int = DV) -> dict[str, np.ndarray]:
    """Model-like inputs in float64: q, k [T, hk, dk] L2-normed (q scaled), v [T, hv, dv], the
    log decay g = -exp(A_log) softplus(.) [T, hv], beta in (0, 1), states [S, hv, dk, dv]."""
    return {"q": l2(rng.standard_normal((T, hk, dk))) * dk ** -0.5,
            "k": l2(rng.standard_normal((T, hk, dk))),
            "v": rng.standard_normal((T, hv, dv)),
            "g": -np.exp(rng.uniform(-2, 1, (T, hv))) * np.log1p(
                np.exp(rng.standard_normal((T, hv)))),
            "beta": 1 / (1 + np.exp(-rng.standard_normal((T, hv)))),
            "state": rng.standard_normal((S, hv, dk, dv)) * 0.5}


def reference(x: dict[str, np.ndarray], cu: np.ndarray, num_seqs: int, fresh: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """float64, token by token: (o [T, hv, dv] (zeros for tokens of no real sequence), states
    [S, hv, dk, dv] after each real sequence's tokens (padding sequences' as given))."""
    q, k, v, g, beta, state = (x[n] for n in ("q", "k", "v", "g", "beta", "state"))
    rep = v.shape[1] // q.shape[1]
    q, k = np.repeat(q, rep, 1), np.repeat(k, rep, 1)
    out, st = np.zeros(v.shape), state.copy()
    for s in range(num_seqs):
        if fresh[s]:
            st[s] = 0
        for t in range(cu[s], cu[s + 1]):
            m = st[s] * np.exp(g[t])[:, None, None]
            delta = (v[t] - np.einsum("hkv,hk->hv", m, k[t])) * beta[t][:, None]
            st[s] = m + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", st[s], q[t])
    return out, st


def layout(news: list[int], num_seqs: int, T: int, fresh: np.ndarray, slots: np.ndarray
           ) -> tuple[deltanet.StepLayout, np.ndarray]:
    cu = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    kv = np.asarray(news, np.int32) + np.where(fresh, 0, 40).astype(np.int32)
    return deltanet.step_layout(cu, kv, np.asarray([num_seqs]), slots, T), cu


def run_jnp(rule, x: dict[str, np.ndarray], lay: deltanet.StepLayout, fresh: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """A jnp form on x's f32 values, q and k repeated to the value heads as the forms take them
    (delta_rule repeats them itself); fresh sequences' states zeroed as _linear_layer does."""
    f = {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}
    rep = 1 if rule is deltanet.delta_rule else x["v"].shape[1] // x["q"].shape[1]
    st = jnp.where(jnp.asarray(fresh)[:, None, None, None], 0, f["state"])
    o, st = jax.jit(rule)(jnp.repeat(f["q"], rep, 1), jnp.repeat(f["k"], rep, 1), f["v"],
                          f["g"], f["beta"], st, lay)
    return np.asarray(o), np.asarray(st)


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= REL * scale, f"{what}: {err:.3g} > {REL} * {scale:.3g}"


# a prefill of several chunks (mid-way: continuing), a decode row, an empty sequence, a
# fresh one of exactly one chunk plus one, a short one, a padding sequence; 7 padding tokens
NEWS = [150, 1, 0, 65, 5, 3]
FRESH = np.array([False, False, False, True, True, False])
NUM_SEQS = 5


@pytest.mark.parametrize("rule", [deltanet.delta_rule_tokens, deltanet.delta_rule_chunked,
                                  deltanet.delta_rule], ids=["tokens", "chunked", "auto"])
def test_forms_match_float64(rule):
    rng = np.random.default_rng(0)
    T = sum(NEWS) + 7
    x = draw(rng, T, len(NEWS))
    lay, cu = layout(NEWS, NUM_SEQS, T, FRESH, np.arange(1, len(NEWS) + 1))
    want_o, want_st = reference(x, cu, NUM_SEQS, FRESH)
    o, st = run_jnp(rule, x, lay, FRESH)
    close(o, want_o, "outputs")
    real = np.arange(len(NEWS)) < NUM_SEQS  # padding sequences' states are not the rule's
    close(st[real], want_st[real], "states")
    assert not o[cu[NUM_SEQS]:].any()  # padding tokens: zeros


def test_decode_step_runs_the_token_form():
    """Every sequence one token: delta_rule's result is the token form's bit for bit."""
    rng = np.random.default_rng(1)
    news, fresh = [1, 1, 1, 0], np.array([False, True, False, False])
    x = draw(rng, 4, 4)
    lay, _ = layout(news, 3, 4, fresh, np.arange(1, 5))
    o, st = run_jnp(deltanet.delta_rule, x, lay, fresh)
    o2, st2 = run_jnp(deltanet.delta_rule_tokens, x, lay, fresh)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(st, st2)


def test_chunked_continues_across_steps():
    """One 200-token sequence cut into steps of 37, 100 and 63 tokens (each chunk grid starting
    mid-way, the state carried) gives the uncut sequence's outputs and final state."""
    rng = np.random.default_rng(2)
    x = draw(rng, 200, 1)
    fresh = np.array([True])
    want_o, want_st = reference(x, np.array([0, 200]), 1, fresh)
    outs, state, at = [], x["state"] * 0, 0
    for n in (37, 100, 63):
        part = {name: a[at:at + n] for name, a in x.items() if name != "state"}
        part["state"] = state
        lay, _ = layout([n], 1, n, np.array([at == 0]), np.array([1]))
        o, st = run_jnp(deltanet.delta_rule_chunked, part, lay, np.array([at == 0]))
        outs.append(o)
        state, at = st.astype(np.float64), at + n
    close(np.concatenate(outs), want_o, "outputs")
    close(state, want_st, "state")


# ---- the C++ kernel (pallas_kernels/deltanet/cpu_deltanet.cc) --------------------------------
# Bound: the same REL; measured 1e-7 (outputs) and 6e-8 (states) for the 16-column SIMD blocks,
# 4e-7 for the portable path (dv = 8), sums over dk in order.

@pytest.fixture(scope="module")
def _kernel(tmp_path_factory):
    from pallas_kernels import cpu_library

    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    if why is not None:
        pytest.skip(f"the CPU kernel library did not build: {why}")
    from pallas_kernels.deltanet import cpu as dn_kernel

    return dn_kernel.delta_rule_in_place


def _run_on_poisoned_cache(kernel, x, lay, num_seqs, fresh, read, dv):
    """The kernel on layer 1 of a NaN-poisoned cache of two layers whose read slots hold the
    carried sequences' states (a fresh sequence's slot stays NaN: it is never read), the cache
    donated through a jit as the step donates it -> (outputs, cache) as numpy."""
    cache = np.full((2, 8, HV, DK, dv), np.nan, np.float32)
    for s in range(num_seqs):
        if not fresh[s]:
            cache[1, read[s]] = x["state"][s]
    f = jax.jit(lambda q, k, v, g, b, c: kernel(q, k, v, g, b, c, lay, layer=jnp.int32(1)),
                donate_argnums=(5,))
    o, c = f(*(jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")),
             jnp.asarray(cache))
    return np.asarray(o), np.asarray(c)


# dv 16: one SIMD block a head; 8: the portable path alone; 24: a SIMD block and a partial one
@pytest.mark.parametrize("dv", [16, 8, 24])
def test_kernel_matches_float64_in_place(_kernel, dv):
    """The layer's slots of a NaN-poisoned cache of two layers: each real sequence's slot holds
    its state after the step; slot 0 (the dummy a padding sequence points at), the slots no
    sequence uses, and the other layer stay NaN (neither read nor written)."""
    rng = np.random.default_rng(3)
    T = sum(NEWS) + 7
    x = draw(rng, T, len(NEWS), dv=dv)
    slots = np.array([3, 5, 2, 7, 1, 0])  # the padding sequence (past NUM_SEQS) at slot 0
    lay, cu = layout(NEWS, NUM_SEQS, T, FRESH, slots)
    want_o, want_st = reference(x, cu, NUM_SEQS, FRESH)
    o, c = _run_on_poisoned_cache(_kernel, x, lay, NUM_SEQS, FRESH, slots, dv)
    close(o, want_o, "outputs")
    assert not o[cu[NUM_SEQS]:].any()
    real = [s for s in range(NUM_SEQS) if NEWS[s]]
    close(c[1, slots[real]], want_st[real], "states")
    untouched = [i for i in range(8) if i not in slots[real]]
    assert np.isnan(c[0]).all() and np.isnan(c[1, [0, 4, 6]]).all()
    assert untouched == [0, 2, 4, 6] and np.isfinite(c[1, 2]).all()  # seq 2: no tokens, kept


def test_kernel_unwritten_slot(_kernel):
    """A real sequence whose write slot is outside the cache (NO_SLOT) gets its outputs; no
    slot is written."""
    rng = np.random.default_rng(4)
    x = draw(rng, 9, 1)
    fresh = np.array([False])
    lay, cu = layout([9], 1, 9, fresh, np.array([2]))
    lay = dataclasses.replace(lay, write_slot=jnp.asarray([deltanet.NO_SLOT], jnp.int32))
    cache = np.zeros((1, 4, HV, DK, DV), np.float32)
    cache[0, 2] = x["state"][0]
    o, c = _kernel(*(jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")),
                   jnp.asarray(cache), lay, layer=jnp.int32(0))
    close(np.asarray(o), reference(x, cu, 1, fresh)[0], "outputs")
    np.testing.assert_array_equal(np.asarray(c), cache)


# dv 128: eight SIMD blocks a head; 24: a SIMD block and a partial one; 8: the portable path
@pytest.mark.parametrize("dv", [128, 24, 8])
def test_kernel_decode_step_in_place(_kernel, dv):
    """A decode step (no sequence with more than one token) takes the kernel's streamed path:
    states read and written where the cache holds them. Sequences carried in place (read slot =
    write slot), carried into another slot, fresh, with no token, with its write slot outside
    the cache (outputs only), and a padding sequence; the slots no sequence writes and the
    other layer keep their NaN poison."""
    rng = np.random.default_rng(5)
    news = [1, 1, 0, 1, 1, 1]
    fresh = np.array([False, False, False, True, False, False])
    num_seqs, T = 5, 8  # 3 padding tokens
    x = draw(rng, T, len(news), dv=dv)
    read = np.array([3, 5, 2, 7, 1, 0])
    lay, cu = layout(news, num_seqs, T, fresh, read)
    write = np.array([3, 6, 2, 7, deltanet.NO_SLOT, 0])  # seq 1 into another slot; 4: none
    lay = dataclasses.replace(lay, write_slot=jnp.asarray(write, jnp.int32))
    want_o, want_st = reference(x, cu, num_seqs, fresh)
    o, c = _run_on_poisoned_cache(_kernel, x, lay, num_seqs, fresh, read, dv)
    close(o, want_o, "outputs")
    assert not o[cu[num_seqs]:].any()
    for s, slot in ((0, 3), (1, 6), (3, 7)):
        close(c[1, slot], want_st[s], f"state of sequence {s}")
    close(c[1, 5], x["state"][1], "sequence 1's read slot")  # read, not written
    close(c[1, 1], x["state"][4], "sequence 4's read slot")  # NO_SLOT: not written
    # seq 2: no tokens, its slot untouched
    np.testing.assert_array_equal(c[1, 2], x["state"][2].astype(np.float32))
    assert np.isnan(c[0]).all() and np.isnan(c[1, [0, 4]]).all()


@pytest.mark.parametrize("dv", [32, 24])
def test_kernel_decode_step_equals_the_blocked_path_bitwise(_kernel, dv):
    """A sequence's one token gives the same bits in a decode step (the cache's rows in place)
    as in a step where another sequence has several tokens (the blocked path, in scratch): its
    result does not depend on what it is batched with."""
    rng = np.random.default_rng(6)
    x = draw(rng, 6, 2, dv=dv)
    fresh = np.array([False, True])
    cache = np.zeros((1, 4, HV, DK, dv), np.float32)
    cache[0, 1] = x["state"][0]
    args = [jnp.asarray(x[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")]
    alone, _ = layout([1, 0], 1, 6, fresh, np.array([1, 2]))  # token 0 of sequence 0 only
    mixed, _ = layout([1, 5], 2, 6, fresh, np.array([1, 2]))  # and 5 tokens of sequence 1
    o1, c1 = _kernel(*args, jnp.asarray(cache), alone, layer=jnp.int32(0))
    o2, c2 = _kernel(*args, jnp.asarray(cache), mixed, layer=jnp.int32(0))
    np.testing.assert_array_equal(np.asarray(o1)[0], np.asarray(o2)[0])
    np.testing.assert_array_equal(np.asarray(c1)[0, 1], np.asarray(c2)[0, 1])
    assert np.asarray(c2)[0, 2].any() and not np.asarray(c1)[0, 2].any()
