"""Bad calls of every handler of the CPU kernel library, each with the words its error must carry,
and good calls beside them (tests/kernels/test_handler_fuzz.py): a bad call must fail alone (an
error naming the bad field: ValueError for INVALID_ARGUMENT, JaxRuntimeError for the other codes),
the process living on and the next call working.

The calls go through jax.ffi.ffi_call directly, past the Python wrappers' own checks, so the
handlers see what a buggy caller (or a corrupted step) would hand them: page ids outside the
cache, negative or oversized kv_lens, cu_q_lens out of order, shapes that disagree, K = 0, a
layer or file offset out of range, group sizes (the expert assignment) that do not fit the rows.
The bad values are drawn from a seeded generator: `variants` draws of each kind.

Run as a script (`python -m tests.helpers.bad_kernel_calls CACHE_DIR SEED VARIANTS [FLAGS...]`)
it registers the library built with FLAGS (the AddressSanitizer build) and runs every case: exit
status 0 when each bad call raised its error and each good call ran, else 1 with the failures.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library

# the AddressSanitizer build (cpu_library.build's extra_flags: after FLAGS, so -O1 wins)
ASAN_FLAGS = ("-O1", "-fsanitize=address", "-fno-omit-frame-pointer")


@dataclass(frozen=True)
class Case:
    handler: str
    name: str
    call: Callable[[], object]  # runs the call and waits for its result
    error: str | None  # words the error must carry; None: a good call, which must run


def _i32(x) -> jax.Array:
    return jnp.asarray(np.asarray(x, np.int64).astype(np.int32))


def _run(f: Callable[[], jax.Array]) -> Callable[[], object]:
    return lambda: np.asarray(f())


# ---- ragged paged attention: q [T, Hq, D], pages [N, P, Hkv, D], S sequences of W pages ------
T, HQ, HKV, D, N, P, S, W = 8, 4, 2, 64, 6, 4, 3, 3


def attention(q, k, v, kv_lens, pages, cu, num_seqs, *, window=(0,), sinks=(), out_shape=None,
              kv_split=512, q_block=16) -> jax.Array:
    out = jax.ShapeDtypeStruct(q.shape if out_shape is None else out_shape, q.dtype)
    return jax.ffi.ffi_call("jaxbatch_ragged_paged_attention", out)(
        q, k, v, _i32(kv_lens), _i32(pages), _i32(cu), _i32(num_seqs), _i32(window),
        jnp.asarray(sinks, jnp.float32), sm_scale=np.float32(D**-0.5), soft_cap=np.float32(0),
        kv_split=np.int64(kv_split), round_p=False, q_block=np.int64(q_block), use_amx=False,
        invariant=False)


def attention_cases(rng: np.random.Generator, variants: int) -> list[Case]:
    q = jnp.asarray(rng.standard_normal((T, HQ, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((N, P, HKV, D)), jnp.float32)
    # two real sequences (2 new tokens of 5, 3 of 9) and a padding slot
    meta = dict(kv_lens=[5, 9, 0], pages=[[1, 2, 0], [3, 4, 5], [0, 0, 0]], cu=[0, 2, 5, 5],
                num_seqs=[2])

    def case(name, error, q=q, k=kv, v=kv, **kw):
        args = {**meta, **kw}
        m = {key: args.pop(key) for key in meta}
        return Case("attention", name, _run(lambda: attention(
            q, k, v, m["kv_lens"], m["pages"], m["cu"], m["num_seqs"], **args)), error)

    cases = [case("good", None),
             # one new token at position 11, window 4: keys 8..11, page 2 only; pages 0 and 1
             # are never read, so ids outside the cache there are no error
             case("window skips pages", None, kv_lens=[12, 0, 0], pages=[[-1, N + 7, 5]] * 3,
                  cu=[0, 1, 1, 1], num_seqs=[1], window=(4,)),
             case("no sequences", None, num_seqs=[0], kv_lens=[-5, 99, 0], cu=[7, 0, 3, 1])]
    for _ in range(variants):
        # a random good batch: q lens and kv lens within the rows and the page table
        ql = rng.integers(0, 3, S)
        kl = [int(rng.integers(a, W * P + 1)) for a in ql]
        cases.append(case("random good", None, kv_lens=kl, pages=rng.integers(0, N, (S, W)),
                          cu=np.concatenate([[0], np.cumsum(ql)]), num_seqs=[S]))
        s, pg = int(rng.integers(0, 2)), int(rng.integers(0, 2))  # a page sequence s reads
        bad = np.array(meta["pages"])
        bad[s, pg] = rng.choice([-1, N, int(rng.integers(N, 2**31)), -(2**31)])
        cases.append(case("page id out of range", "is not a page of k_pages", pages=bad))
        kl = list(meta["kv_lens"])
        kl[s] = rng.choice([int(rng.integers(-(2**31), 0)), W * P + 1,
                            int(rng.integers(W * P + 1, 2**31))])
        cases.append(case("kv_len out of range", "kv_lens out of [0,", kv_lens=kl))
        cases.append(case("more new tokens than kv_len", "more new tokens",
                          kv_lens=[1, 9, 0]))
        cases.append(case("cu_q_lens decreasing", "not non-decreasing",
                          cu=[0, int(rng.integers(3, 6)), 2, 5]))
        cases.append(case("cu_q_lens past q's rows", "past q's rows", kv_lens=[5, 12, 0],
                          cu=[0, 2, int(rng.integers(T + 1, 13)), 5]))
        cases.append(case("cu_q_lens negative", "cu_q_lens[0] is negative",
                          cu=[int(rng.integers(-(2**31), 0)), 2, 5, 5]))
        cases.append(case("num_seqs out of range", "num_seqs out of",
                          num_seqs=[rng.choice([-1, S + 1, -(2**31), 2**31 - 1])]))
    return cases + [
        case("v's shape", "v_pages' shape is not k_pages'", v=kv[:-1]),
        case("out's shape", "out's shape is not q's", out_shape=(T, HQ, D + 1)),
        case("heads", "multiple of num_kv_heads", q=q[:, :3]),
        case("sinks", "sinks must be [num_q_heads]", sinks=(0.0, 1.0, 2.0)),
        case("head dim", "head dim", q=q[..., :32]),
        case("q_block", "q_block in [1, 2^31)", q_block=2**40),
        case("kv_split", "kv_split must be positive", kv_split=0),
        case("num_seqs shape", "hold one value each", num_seqs=[2, 2]),
        case("kv_lens too short", "num_seqs out of", kv_lens=[5]),
        case("cu_q_lens too short", "num_seqs out of", cu=[0, 2]),
        # a split of 2^55 keys: the scratch vector throws std::length_error in a pool task,
        # which comes back as this call's error (not std::terminate)
        case("exception in a pool task", "a worker thread failed", kv_split=2**55),
    ]


# ---- the quantised matmul (Q8_0: 32 weights, 34 bytes a block), small and routed matmuls ---
M, K, NOUT, RB, L, E = 4, 64, 16, 68, 2, 3


def quant_matmul(x, w, layer, *, k=K, n=0, fmt=0, act=0, out_shape=None) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], NOUT) if out_shape is None else out_shape,
                               jnp.float32)
    return jax.ffi.ffi_call("jaxbatch_quant_matmul", out)(
        x, w, _i32(layer), fmt=np.int64(fmt), k=np.int64(k), act=np.int64(act), n=np.int64(n))


def _q8_rows(rng, rows: int) -> np.ndarray:
    """Q8_0 rows uint8 [rows, RB]: small f16 scales, random codes."""
    b = rng.integers(0, 256, (rows, K // 32, 34), dtype=np.uint8)
    b[..., :2] = np.full((rows, K // 32, 1), 0.01, np.float16).view(np.uint8)
    return b.reshape(rows, RB)


def quant_cases(rng: np.random.Generator, variants: int) -> list[Case]:
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(np.stack([_q8_rows(rng, NOUT) for _ in range(L)]))
    units = NOUT * RB // 32  # one layer's rows, in 32-byte units
    file = jnp.asarray(np.concatenate([w.reshape(-1), np.zeros(64, np.uint8)]).reshape(-1, 32))
    g = file.shape[0]

    def case(name, error, **kw):
        a = {"x": x, "w": w, "layer": [1], **kw}
        return Case("quant", name, _run(lambda: quant_matmul(a.pop("x"), a.pop("w"),
                                                             a.pop("layer"), **a)), error)

    good = cpu_library.has("quant_matmul_f32")  # else the good calls' error: no f32 path
    cases = [case("good", None), case("good in file", None, w=file, layer=[units, 0],
                                       n=NOUT)] if good else []
    if cpu_library.has("quant_matmul_int8"):  # the int8 mode's few-row and wide paths
        x20 = jnp.asarray(rng.standard_normal((20, K)), jnp.float32)
        cases += [case("good int8", None, act=1),
                  case("good int8 in file", None, act=1, w=file, layer=[units, 0], n=NOUT),
                  case("good int8, 20 rows", None, act=1, x=x20, out_shape=(20, NOUT))]
    if cpu_library.has("quant_matmul_panel"):  # the panel mode's decode and prefill paths
        bf = lambda a: jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.bfloat16), jnp.uint16)
        xb, xb20 = bf(rng.standard_normal((M, K))), bf(rng.standard_normal((20, K)))
        wb = jnp.asarray(np.asarray(rng.standard_normal((L, NOUT, K)) * 0.1, jnp.bfloat16)
                         .view(np.uint8))  # BF16 rows [L, N, 2K]; as panels just other values
        for act, name in ((3, "panel"), (4, "packed panels")):
            cases += [case(f"good {name}", None, x=xb, w=wb, fmt=5, act=act),
                      case(f"good {name}, 20 rows", None, x=xb20, w=wb, fmt=5, act=act,
                           out_shape=(20, NOUT))]
    for _ in range(variants):
        cases.append(case("layer out of range", "layer out of range",
                          layer=[rng.choice([L, int(rng.integers(L, 2**31)), -1, -(2**31)])]))
        cases.append(case("offset past the file", "offset out of the file", w=file, n=NOUT,
                          layer=[int(rng.integers(g - units + 1, 2**31)), 0]))
        # 2^32 units and more: a 32-bit offset would have wrapped into the file
        cases.append(case("offset's high word", "offset out of the file", w=file, n=NOUT,
                          layer=[0, int(rng.integers(1, 2**31))]))
        cases.append(case("negative offset", "offset out of the file", w=file, n=NOUT,
                          layer=[0, int(rng.integers(-(2**31), 0))]))
    return cases + [
        case("K = 0", "K must be a positive multiple", x=x[:, :0], k=0, w=w[:, :, :0]),
        case("K not whole blocks", "K must be a positive multiple", x=x[:, :40], k=40),
        case("k attribute", "bad shapes", k=2 * K),
        case("row bytes", "bad shapes", w=w[:, :, :-2]),
        case("out's shape", "bad shapes", out_shape=(M, NOUT + 1)),
        case("format", "unknown format", fmt=99),
        case("act", "act is 0, 1", act=9),
        case("int8 BF16", "take float activations", fmt=5, act=1, w=w[:, :, :128]),
        case("layer words", "quant_matmul: x [M, K]", layer=[1, 0]),
        case("file layer word", "quant_matmul: x [M, K]", w=file, n=NOUT, layer=[1]),
        case("x dtype", "quant_matmul: x [M, K]", x=x.astype(jnp.int32)),
    ]


def small_matmul(x, w, layer, out_shape=None) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1] * 16) if out_shape is None else out_shape,
                               jnp.uint16)
    return jax.ffi.ffi_call("jaxbatch_small_matmul", out)(x, w, _i32(layer))


def small_cases(rng: np.random.Generator, variants: int) -> list[Case]:
    if not cpu_library.has("small_matmul"):  # every call: "needs AVX512-BF16, AVX2 with FMA, ..."
        return []
    bf = lambda a: jax.lax.bitcast_convert_type(jnp.asarray(a, jnp.bfloat16), jnp.uint16)
    x = bf(rng.standard_normal((M, K)))
    w = bf(rng.standard_normal((L, 1, K // 2, 32)) * 0.1)

    def case(name, error, **kw):
        a = {"x": x, "w": w, "layer": [1], **kw}
        return Case("small", name, _run(lambda: small_matmul(**a)), error)

    cases = [case("good", None)]
    for _ in range(variants):
        cases.append(case("layer out of range", "layer out of range",
                          layer=[rng.choice([L, int(rng.integers(L, 2**31)), -1, -(2**31)])]))
    return cases + [
        case("K = 0", "K must be positive and even", x=x[:, :0], w=w[:, :, :0]),
        case("K odd", "K must be positive and even", x=x[:, :3]),
        case("w's K", "bad shapes", w=w[:, :, :-1]),
        case("out's shape", "bad shapes", out_shape=(M, 32)),
        case("x dtype", "small_matmul: x [M, K]", x=x.astype(jnp.float32)),
    ]


def moe_matmul(x, w, layer, group_sizes, *, k=K, n=NOUT, experts=E, in_file=0,
               out_shape=None) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], NOUT) if out_shape is None else out_shape,
                               jnp.float32)
    return jax.ffi.ffi_call("jaxbatch_moe_matmul", out)(
        x, w, _i32(layer), _i32(group_sizes), fmt=np.int64(0), k=np.int64(k), n=np.int64(n),
        experts=np.int64(experts), act=np.int64(0), in_file=np.int64(in_file))


def moe_cases(rng: np.random.Generator, variants: int) -> list[Case]:
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(np.stack([_q8_rows(rng, E * NOUT) for _ in range(L)]))
    units = E * NOUT * RB // 32
    file = jnp.asarray(w.reshape(-1, 32))
    g = file.shape[0]

    def case(name, error, **kw):
        a = {"x": x, "w": w, "layer": [1], "group_sizes": [1, 0, 2], **kw}
        return Case("moe", name, _run(lambda: moe_matmul(
            a.pop("x"), a.pop("w"), a.pop("layer"), a.pop("group_sizes"), **a)), error)

    good = cpu_library.has("quant_matmul_f32")
    cases = [case("good", None), case("good in file", None, w=file, layer=[units, 0],
                                       in_file=1)] if good else []
    for _ in range(variants):
        gs = [int(v) for v in rng.integers(0, 2, E)]
        gs[int(rng.integers(0, E))] = int(rng.integers(-(2**31), 0))
        cases.append(case("negative group size", "a negative group size", group_sizes=gs))
        cases.append(case("more rows than M", "more than M rows",
                          group_sizes=[int(v) for v in rng.integers(M // E + 1, 2**28, E)]))
        cases.append(case("layer out of range", "layer out of range",
                          layer=[rng.choice([L, int(rng.integers(L, 2**31)), -1, -(2**31)])]))
        cases.append(case("offset past the file", "offset out of the file", w=file, in_file=1,
                          layer=[int(rng.integers(g - units + 1, 2**31)), 0]))
        cases.append(case("offset's high word", "offset out of the file", w=file, in_file=1,
                          layer=[units, int(rng.integers(1, 2**31))]))
    return cases + [
        # group e is expert e: a group sizes array longer than E would route rows to experts
        # past the weight
        case("expert past E", "bad shapes", group_sizes=[1, 0, 2, 1]),
        case("experts attribute", "w is not [L, E * N, RB]", experts=E + 1,
             group_sizes=[1, 0, 2, 1]),
        case("K = 0", "bad shapes", x=x[:, :0], k=0, w=w[:, :, :0]),
        case("layer words", "moe_matmul: x [M, K]", layer=[1, 0]),
    ]


# ---- the delta rule: 3 sequences of 2, 3 and 0 tokens in 6 rows, a cache of 2 layers x 4 slots -
DT, DHK, DHV, DDK, DDV, DL, DN = 6, 1, 2, 8, 16, 2, 4


def delta_rule(q, k, v, g, beta, state, layer, start, length, read, write, fresh
               ) -> tuple[jax.Array, jax.Array]:
    outs = (jax.ShapeDtypeStruct(v.shape, jnp.float32),
            jax.ShapeDtypeStruct(state.shape, jnp.float32))
    return jax.ffi.ffi_call("jaxbatch_delta_rule", outs, input_output_aliases={5: 1})(
        q, k, v, g, beta, state, _i32(layer), _i32(start), _i32(length), _i32(read),
        _i32(write), _i32(fresh))


def deltanet_cases(rng: np.random.Generator, variants: int) -> list[Case]:
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
    x = {"q": f(DT, DHK, DDK), "k": f(DT, DHK, DDK), "v": f(DT, DHV, DDV), "g": -jnp.abs(
        f(DT, DHV)), "beta": jax.nn.sigmoid(f(DT, DHV)), "state": f(DL, DN, DHV, DDK, DDV),
        "layer": [1], "start": [0, 2, 5], "length": [2, 3, 0], "read": [1, 2, 0],
        "write": [1, 2, 2**31 - 1], "fresh": [0, 1, 0]}

    def case(name, error, **kw):
        a = {**x, **kw}
        return Case("deltanet", name, _run(lambda: delta_rule(**a)[0]), error)

    cases = [case("good", None), case("not written", None, write=[2**31 - 1, -1, 0]),
             case("no tokens", None, length=[0, 0, 0], read=[-5, 99, 0])]
    for _ in range(variants):
        s = int(rng.integers(0, 2))
        bad = list(x["read"])
        bad[0] = rng.choice([-1, DN, int(rng.integers(DN, 2**31)), -(2**31)])
        cases.append(case("read slot out of range", "read slot out of range", read=bad))
        cases.append(case("layer out of range", "layer out of range",
                          layer=[rng.choice([DL, int(rng.integers(DL, 2**31)), -1])]))
        ln = list(x["length"])
        ln[s] = int(rng.integers(DT, 2**31 - 8))
        cases.append(case("tokens past the rows", "past q's rows", length=ln))
        ln = list(x["length"])
        ln[s] = int(rng.integers(-(2**31), 0))
        cases.append(case("negative token count", "negative token count", length=ln))
        cases.append(case("overlapping tokens", "out of order or overlapping",
                          start=[0, int(rng.integers(0, 2)), 5]))
    return cases + [
        case("one slot written twice", "two sequences write one state slot", write=[1, 1, 3]),
        case("a slot read and written by others", "reads the slot another writes",
             write=[2, 3, 0], fresh=[0, 0, 0]),
        case("heads", "multiple of Hk", v=f(DT, 3, DDV), g=f(DT, 3), beta=f(DT, 3),
             state=f(DL, DN, 3, DDK, DDV), q=f(DT, 2, DDK), k=f(DT, 2, DDK)),
        case("k's shape", "k's shape is not q's", k=f(DT, DHK, DDK + 1)),
        case("g's shape", "g, beta [T, Hv]", g=f(DT + 1, DHV)),
        case("state's dims", "state's heads or dims", state=f(DL, DN, DHV, DDK, DDV + 1)),
        case("per-sequence arrays", "one value a sequence", fresh=[0, 1]),
        case("layer words", "one layer index", layer=[1, 0]),
    ]


def zeros_cases(rng: np.random.Generator, variants: int) -> list[Case]:
    del rng, variants
    make = lambda shape: _run(lambda: jax.ffi.ffi_call(
        "jaxbatch_untouched_zeros", jax.ShapeDtypeStruct(shape, jnp.float32),
        has_side_effect=True)())
    return [Case("zeros", "empty", make((0,)), None),
            Case("zeros", "pages", make((3, 4096)), None)]


ALL = {"attention": attention_cases, "quant": quant_cases, "small": small_cases,
       "moe": moe_cases, "zeros": zeros_cases, "deltanet": deltanet_cases}


# what jax raises for a handler's error: ValueError for INVALID_ARGUMENT, JaxRuntimeError for the
# other codes (RESOURCE_EXHAUSTED, INTERNAL, UNIMPLEMENTED)
ERRORS = (ValueError, jax.errors.JaxRuntimeError)


def check(case: Case) -> str | None:
    """None when the case behaved (a bad call raised its error, a good call ran), else why not."""
    try:
        out = case.call()
    except ERRORS as e:
        if case.error is None:
            return f"{case.handler} {case.name}: a good call failed: {e}"
        if case.error not in str(e):
            return f"{case.handler} {case.name}: error without {case.error!r}: {e}"
        return None
    if case.error is not None:
        return f"{case.handler} {case.name}: ran, expected an error with {case.error!r}"
    if case.handler != "zeros" and not np.isfinite(np.asarray(out, np.float32)).all():
        return f"{case.handler} {case.name}: non-finite output"
    if case.handler == "zeros" and np.asarray(out).any():
        return f"{case.handler} {case.name}: not zeros"
    return None


def main(argv: list[str]) -> int:
    cache_dir, seed, variants, *flags = argv
    cpu_library.register(cache_dir, tuple(flags))
    rng = np.random.default_rng(int(seed))
    cases = [c for make in ALL.values() for c in make(rng, int(variants))]
    failures = [f for f in map(check, cases) if f is not None]
    print(f"{len(cases)} calls, {len(failures)} misbehaved", flush=True)
    for f in failures:
        print(f, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
