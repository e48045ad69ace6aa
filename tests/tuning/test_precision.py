"""dtype auto: the engine measures its own matmul shapes in both dtypes, computes in the faster
one (a clear win for bf16 only), and caches the measurement per device, kernel library, jaxbatch
and jax version."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxbatch import LLM
from jaxbatch.model.archs import llama
from jaxbatch.tuning import precision
from tests.helpers.tiny_models import make_tiny_model


@pytest.mark.parametrize("f32_s,bf16_s,want", [(1.0, 0.5, "bfloat16"), (1.0, 0.95, "float32"),
                                               (0.5, 1.0, "float32")])
def test_faster_dtype_is_chosen_and_cached(tmp_path, monkeypatch, f32_s, bf16_s, want):
    calls = []

    def fake_time(dtype, hidden, inner, repeats=5):
        calls.append(jnp.dtype(dtype).name)
        return bf16_s if jnp.dtype(dtype) == jnp.bfloat16 else f32_s

    monkeypatch.setattr(precision, "_time_matmuls", fake_time)
    first = precision.choose_compute_dtype(64, 128, str(tmp_path))
    assert (first.dtype, first.source) == (want, "measured")
    assert sorted(calls) == ["bfloat16", "float32"]
    assert first.gflops["bfloat16"] / first.gflops["float32"] == pytest.approx(f32_s / bf16_s)
    again = precision.choose_compute_dtype(64, 128, str(tmp_path))
    assert (again.dtype, again.source, again.gflops) == (want, "cache", first.gflops)
    assert len(calls) == 2  # read from the cache, not measured again
    other = precision.choose_compute_dtype(64, 256, str(tmp_path))  # other shapes: measured
    assert other.source == "measured"


def test_a_changed_kernel_library_is_measured_again(tmp_path, monkeypatch):
    """The cache key holds the kernel library's content hash: a kernel change (here: another
    hash) measures again by itself; the same hash reads the cache."""
    from pallas_kernels import cpu_library
    from pallas_kernels.matmul import small_bf16

    calls = []
    monkeypatch.setattr(precision, "_time_matmuls",
                        lambda dtype, *a, **k: calls.append("dtype") or 1.0)
    monkeypatch.setattr(precision, "_time_layer_stack",
                        lambda *a, **k: calls.append("small") or 1.0)
    monkeypatch.setattr(small_bf16, "available", lambda: True)

    def choose() -> tuple[str, int]:
        return (precision.choose_compute_dtype(64, 128, str(tmp_path)).source,
                precision.choose_small_matmul(64, 128, 2, str(tmp_path)))

    monkeypatch.setattr(cpu_library, "content_hash", lambda: "kernels-a")
    assert choose() == ("measured", 0) and len(calls) == 2 + 2 * 4
    assert choose() == ("cache", 0) and len(calls) == 2 + 2 * 4
    monkeypatch.setattr(cpu_library, "content_hash", lambda: "kernels-b")
    assert choose() == ("measured", 0) and len(calls) == 2 * (2 + 2 * 4)
    monkeypatch.setattr(cpu_library, "content_hash", lambda: "kernels-a")  # both kept
    assert choose() == ("cache", 0) and len(calls) == 2 * (2 + 2 * 4)


def test_kernel_library_hash_follows_its_sources(tmp_path, monkeypatch):
    """Unregistered, the hash is of the sources and flags: an edited source is another hash."""
    from pallas_kernels import cpu_library

    monkeypatch.setattr(cpu_library, "_registered", None)
    before = cpu_library.content_hash()
    edited = tmp_path / "edited.cc"
    edited.write_bytes(open(cpu_library.SOURCES[0], "rb").read() + b"\n// edited\n")
    monkeypatch.setattr(cpu_library, "SOURCES", (str(edited), *cpu_library.SOURCES[1:]))
    cpu_library._sources_hash.cache_clear()
    try:
        assert cpu_library.content_hash() != before
    finally:
        cpu_library._sources_hash.cache_clear()  # not kept for the real sources
    # registered: the built library's own key (its file name)
    monkeypatch.setattr(cpu_library, "_registered", "/c/kernels/jaxbatch-cpu-0123abcd.so")
    assert cpu_library.content_hash() == "0123abcd"


def test_device_identity_counts_the_cpus_this_process_may_use(monkeypatch):
    """A process pinned to 3 CPUs (taskset, a container's cpuset) is another device than the
    whole machine; without affinity (not Linux) os.cpu_count() stands in."""
    import os

    if precision.jax.default_backend() != "cpu":
        pytest.skip("the CPU count is part of a CPU device's identity only")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert precision.device_identity().endswith(":3")
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert precision.device_identity().endswith(":7")


@pytest.mark.parametrize("kernel_s,bf16_xla_s,decode_s,want,timed", [
    (0.5, 1.0, 1.0, "bfloat16", ["float32", "kernel"]),  # the kernel wins: XLA bf16 untimed
    (0.95, 0.5, 1.0, "bfloat16", ["float32", "kernel", "bfloat16"]),  # XLA's bf16 dot (AMX)
    (0.95, 0.95, 1.0, "float32", ["float32", "kernel", "bfloat16", "f32 1", "kernel 1"]),
    # no clear win at prefill, but a decode step reading half the bytes (an AVX2 machine)
    (0.95, 0.95, 0.5, "bfloat16", ["float32", "kernel", "bfloat16", "f32 1", "kernel 1"]),
    # ... unless the kernel's prefill is clearly slower than f32's
    (1.5, 1.5, 0.5, "float32", ["float32", "kernel", "bfloat16", "f32 1", "kernel 1"]),
])
def test_bf16_kernel_is_bf16s_candidate(tmp_path, monkeypatch, kernel_s, bf16_xla_s, decode_s,
                                        want, timed):
    """Where the linears would run the quantised matmul's kernel in bf16 (one CPU device), the
    kernel is timed for bf16 first, XLA's bf16 dot only if the kernel does not win; bf16's rate
    is the better of the two, against XLA's f32 dot (1.0 s here). Where neither wins, a decode
    step is timed in both (f32's 1.0 s): a clear win there, with the kernel's prefill not
    clearly slower, picks bfloat16."""
    calls = []

    def fake_xla(dtype, hidden, inner, repeats=3):
        calls.append(jnp.dtype(dtype).name)
        return bf16_xla_s if jnp.dtype(dtype) == jnp.bfloat16 else 1.0

    def fake_kernel(hidden, inner):
        calls.append("kernel")
        return kernel_s

    monkeypatch.setattr(precision, "_time_decode_f32",
                        lambda hidden, inner: calls.append("f32 1") or 1.0)
    monkeypatch.setattr(precision, "_time_bf16_rows_decode",
                        lambda hidden, inner: calls.append("kernel 1") or decode_s)
    monkeypatch.setattr(precision, "_time_matmuls", fake_xla)
    monkeypatch.setattr(precision, "_time_bf16_rows", fake_kernel)
    monkeypatch.setattr(precision, "_bf16_kernel_available", lambda: True)
    choice = precision.choose_compute_dtype(64, 128, str(tmp_path), bf16_kernel=True)
    assert (choice.dtype, calls) == (want, timed)
    assert choice.gflops["bfloat16 kernel"] / choice.gflops["float32"] == \
        pytest.approx(1.0 / kernel_s)
    again = precision.choose_compute_dtype(64, 128, str(tmp_path), bf16_kernel=True)
    assert (again.dtype, again.source, len(calls)) == (want, "cache", len(timed))
    # without the kernel's path (another device, tensor parallel): XLA's dots, cached apart
    plain = precision.choose_compute_dtype(64, 128, str(tmp_path), bf16_kernel=False)
    assert plain.source == "measured" and "bfloat16 kernel" not in plain.gflops


def test_real_bf16_kernel_measurement_runs(tmp_path):
    from pallas_kernels import cpu_library

    if cpu_library.available(str(tmp_path / "kernels")) is not None or \
            not precision._bf16_kernel_available():
        pytest.skip("no bf16 quantised matmul on this CPU (AVX512-BF16) or no C++ library")
    saved = precision._QUANT_ACT_BYTES
    try:
        precision._QUANT_ACT_BYTES = 1 << 20
        choice = precision.choose_compute_dtype(64, 128, str(tmp_path), bf16_kernel=True)
    finally:
        precision._QUANT_ACT_BYTES = saved
    assert choice.dtype in ("float32", "bfloat16")
    assert 0 < choice.gflops["bfloat16 kernel"] < 1e6


def test_real_measurement_is_sane(tmp_path):
    choice = precision.choose_compute_dtype(64, 128, str(tmp_path))
    assert choice.dtype in ("float32", "bfloat16")
    assert all(0 < v < 1e6 for v in choice.gflops.values())


def test_engine_with_dtype_auto_computes_in_the_chosen_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "_time_matmuls",
                        lambda dtype, *a, **k: 0.5 if jnp.dtype(dtype) == jnp.bfloat16 else 1.0)
    d = str(tmp_path / "m")
    make_tiny_model("llama_gqa", d)
    llm = LLM(d, dtype="auto", cache_dir=str(tmp_path / "cache"), max_model_len=64,
              num_pages=16, max_num_batched_tokens=16, max_num_seqs=2, planner="fixed:[(16,2)]",
              attention_backend="reference", progress=False)
    eng = llm.engine
    assert eng.config.model.dtype == "bfloat16" and eng.precision is not None
    assert llama.value_dtype(eng.runner.params["final_norm"]) == jnp.bfloat16
    assert eng.runner.kv_dtype == jnp.bfloat16  # kv_cache_dtype auto follows the compute dtype
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16


# kernel seconds per rows measured; XLA's are 1.0 at every size
@pytest.mark.parametrize("kernel_s,want", [
    ({4: 0.5, 16: 0.5, 64: 0.8, 256: 1.2}, 64),   # loses at 256 rows: up to 64
    ({4: 0.5, 16: 0.95, 64: 0.5, 256: 0.5}, 4),   # not a clear win at 16: never above 4
    ({4: 0.95, 16: 0.5, 64: 0.5, 256: 0.5}, 0),   # no clear win at a decode step: off
    ({4: 0.5, 16: 0.5, 64: 0.5, 256: 0.5}, 256),
])
def test_small_matmul_rows_are_where_it_wins(tmp_path, monkeypatch, kernel_s, want):
    from pallas_kernels.matmul import small_bf16

    calls = []

    def fake_time(hidden, inner, layers, packed, rows, repeats=9):
        calls.append((packed, rows))
        return kernel_s[rows] if packed else 1.0

    monkeypatch.setattr(precision, "_time_layer_stack", fake_time)
    monkeypatch.setattr(small_bf16, "available", lambda: True)
    assert precision.choose_small_matmul(64, 128, 2, str(tmp_path)) == want
    assert sorted(calls) == sorted((p, r) for r in precision.SMALL_MATMUL_ROWS
                                   for p in (False, True))
    assert precision.choose_small_matmul(64, 128, 2, str(tmp_path)) == want  # cached
    assert len(calls) == 2 * len(precision.SMALL_MATMUL_ROWS)


def _fake_quant_timer(monkeypatch, seconds):
    """The quantised kernel's timing replaced by `seconds(act, rows)` (and reported available);
    returns the list the timed (format, act, rows) are appended to."""
    from pallas_kernels.matmul import quant

    calls = []

    def fake_time(fmt, n, k, act, rows, repeats=5):
        calls.append((fmt, act, rows))
        return seconds(act, rows)

    def fake_timer(fmt, n, k, act, rows):
        calls.append((fmt, act, rows))
        return lambda: seconds(act, rows)

    monkeypatch.setattr(precision, "_time_quant", fake_time)
    monkeypatch.setattr(precision, "_quant_timer", fake_timer)
    monkeypatch.setattr(quant, "available", lambda dtype, act="float": True)
    return calls


def test_quant_activation_modes_timed_in_turn(tmp_path, monkeypatch):
    """A busy spell during one mode's first timings does not decide: the modes take turns and
    each keeps its fastest call (int8 4 ms then 0.1 ms, float 0.17 ms throughout -> int8)."""
    from pallas_kernels.matmul import quant

    order = []

    def fake_timer(fmt, n, k, act, rows):
        left = {"n": 2}  # this mode's first two calls land in the busy spell

        def timed():
            order.append(act)
            left["n"] -= 1
            busy = left["n"] >= 0 and act == "int8"
            return (4e-3 if busy else 1e-4) if act == "int8" else 1.7e-4
        return timed

    monkeypatch.setattr(precision, "_quant_timer", fake_timer)
    monkeypatch.setattr(quant, "available", lambda dtype, act="float": True)
    got = precision.choose_quant_acts({("Q4_K", 1536, 1536)}, "bfloat16", str(tmp_path))
    assert got == {("Q4_K", 1536, 1536): "int8"}
    assert order[:4] == ["float", "int8", "float", "int8"]


@pytest.mark.parametrize("int8_s,want", [
    ({1: 0.5, 256: 0.5}, "int8"),    # faster at both step sizes
    ({1: 0.5, 256: 1.5}, "int8"),    # geometric mean 0.87: decode's gain outweighs prefill's loss
    ({1: 0.9, 256: 1.5}, "float"),   # geometric mean 1.16
    ({1: 1.2, 256: 1.0}, "float"),
])
def test_quant_activation_mode_is_the_faster_and_cached(tmp_path, monkeypatch, int8_s, want):
    calls = _fake_quant_timer(monkeypatch, lambda act, rows: int8_s[rows] if act == "int8"
                              else 1.0)
    shapes = {("Q4_K", 512, 2048), ("Q6_K", 2048, 512)}
    got = precision.choose_quant_acts(shapes, "bfloat16", str(tmp_path))
    assert got == {s: want for s in shapes}
    assert len(calls) == 2 * 2 * len(precision.QUANT_ACT_ROWS)
    assert precision.choose_quant_acts(shapes, "bfloat16", str(tmp_path)) == got  # cached
    assert len(calls) == 2 * 2 * len(precision.QUANT_ACT_ROWS)
    # float32 compute keeps float activations (exactness against float32 references)
    assert precision.choose_quant_acts(shapes, "float32", str(tmp_path)) == {}


def test_quant_activation_measurement_runs(tmp_path):
    """The real measurement on a small shape: both modes run and one is chosen (skipped where
    the CPU has no int8 path)."""
    from pallas_kernels import cpu_library
    from pallas_kernels.matmul import quant

    if cpu_library.available(str(tmp_path / "kernels")) is not None or \
            not quant.available(jnp.bfloat16, act="int8"):
        pytest.skip("no quantised int8 matmul on this CPU (AVX512-VNNI) or no C++ library")
    got = _small_stacks(lambda: precision.choose_quant_acts({("Q8_0", 64, 256)}, "bfloat16",
                                                            str(tmp_path)))
    assert got[("Q8_0", 64, 256)] in ("int8", "float")


def _small_stacks(choose):
    """choose() with the timed weight stacks at 1 MB (a real measurement, kept short)."""
    saved = precision._QUANT_ACT_BYTES
    try:
        precision._QUANT_ACT_BYTES = 1 << 20
        return choose()
    finally:
        precision._QUANT_ACT_BYTES = saved


@pytest.mark.parametrize("amx_s,want", [
    ({1: 0.9, 256: 0.3}, "amx"),
    ({1: 1.5, 256: 0.5}, "amx"),     # geometric mean 0.87
    ({1: 2.0, 256: 0.6}, "float"),   # geometric mean 1.10
])
def test_bf16_rows_take_amx_tiles_where_faster(tmp_path, monkeypatch, amx_s, want):
    """BF16 rows choose between the float mode and AMX tiles as the block formats choose int8;
    F16 rows and an N that is not a multiple of 16 (no AMX path) keep "float" untimed."""
    calls = _fake_quant_timer(monkeypatch, lambda act, rows: amx_s[rows] if act == "amx"
                              else 1.0)
    shapes = {("BF16", 512, 2048), ("F16", 512, 2048), ("BF16", 40, 64)}
    got = precision.choose_quant_acts(shapes, "bfloat16", str(tmp_path))
    assert got == {("BF16", 512, 2048): want, ("F16", 512, 2048): "float",
                   ("BF16", 40, 64): "float"}
    assert sorted(calls) == sorted(("BF16", act, rows) for act in ("float", "amx")
                                   for rows in precision.QUANT_ACT_ROWS)


def test_bf16_route_times_the_kernel_in_its_chosen_mode(tmp_path, monkeypatch):
    calls = _fake_quant_timer(monkeypatch, lambda act, rows: 2.0 if act == "float" else 1.0)
    got = precision.choose_bf16_route({(512, 2048)}, str(tmp_path), {(512, 2048): "amx"})
    assert got == {}  # AMX tiles hold at 512 rows: never XLA's dot
    assert {act for _, act, _ in calls} == {"amx", "xla"}
    # the float mode's route is cached apart (another mode, another crossover)
    assert precision.choose_bf16_route({(512, 2048)}, str(tmp_path)) == {(512, 2048): 64}


def test_amx_measurement_runs(tmp_path):
    """The real measurement on a small BF16 shape (skipped without AMX-BF16)."""
    from pallas_kernels import cpu_library
    from pallas_kernels.matmul import quant

    if cpu_library.available(str(tmp_path / "kernels")) is not None or \
            not quant.available(jnp.bfloat16, act="amx"):
        pytest.skip("no AMX-BF16 on this CPU (or OS, or build) or no C++ library")
    got = _small_stacks(lambda: precision.choose_quant_acts({("BF16", 64, 256)}, "bfloat16",
                                                            str(tmp_path)))
    assert got[("BF16", 64, 256)] in ("amx", "float")


@pytest.mark.parametrize("xla_s, want, sizes_timed", [
    ({64: 1.0, 96: 1.0, 128: 1.0, 256: 1.0, 512: 1.0}, None, 1),  # never clearly faster
    ({64: 2.0, 96: 2.0, 128: 1.0, 256: 0.8, 512: 0.5}, 256, 3),   # faster from 256 rows on
    ({64: 0.5, 96: 0.5, 128: 0.5, 256: 1.0, 512: 0.5}, 512, 2),   # 256 not: only from 512
    ({64: 0.5, 96: 0.5, 128: 0.5, 256: 0.5, 512: 0.5}, 64, 5),
    ({64: 0.5, 96: 0.5, 128: 0.5, 256: 0.5, 512: 1.0}, None, 1),  # the kernel holds at 512
])
def test_bf16_route_from_the_measured_crossover_and_cached(tmp_path, monkeypatch, xla_s, want,
                                                           sizes_timed):
    """XLA's dot takes BF16-row steps from the smallest timed size where it is >= 1.1x faster
    there and at every larger one; the kernel's time is 1.0 at each size here. Sizes are timed
    from the largest down, stopping at the first where the kernel holds."""
    calls = _fake_quant_timer(monkeypatch, lambda act, rows: xla_s[rows] if act == "xla"
                              else 1.0)
    shapes = {(512, 2048), (2048, 512)}
    got = precision.choose_bf16_route(shapes, str(tmp_path))
    assert got == ({} if want is None else {s: want for s in shapes})
    assert len(calls) == 2 * 2 * sizes_timed  # 2 shapes x (kernel, XLA) per size
    assert {rows for _, _, rows in calls} == set(sorted(precision.BF16_XLA_ROWS)[-sizes_timed:])
    assert {f for f, _, _ in calls} == {"BF16"}
    assert precision.choose_bf16_route(shapes, str(tmp_path)) == got  # cached
    assert len(calls) == 2 * 2 * sizes_timed


def test_bf16_route_measurement_runs(tmp_path):
    """The real measurement on a small shape: the kernel and XLA's dot both run on the same
    BF16 rows (skipped where the CPU has no bf16 quantised matmul)."""
    from pallas_kernels import cpu_library
    from pallas_kernels.matmul import quant

    if cpu_library.available(str(tmp_path / "kernels")) is not None or \
            not quant.available(jnp.bfloat16):
        pytest.skip("no bf16 quantised matmul on this CPU (AVX512-BF16) or no C++ library")
    got = _small_stacks(lambda: precision.choose_bf16_route({(64, 256)}, str(tmp_path)))
    assert got.get((64, 256), 0) in (0, *precision.BF16_XLA_ROWS)


def test_a_level_below_the_cpu_keeps_the_kernels_untimed(tmp_path, monkeypatch):
    """At a JAXBATCH_CPU_LEVEL below what the CPU runs, XLA's dots (which keep to the CPU, not
    the level) are never timed against the kernels: bf16 on the kernel, the small matmul up to
    its largest size, BF16 rows on the kernel at every step size."""
    from pallas_kernels.matmul import small_bf16

    def no_timing(*a, **k):
        raise AssertionError("timed against XLA's dot at a level below the CPU")

    for name in ("_time_matmuls", "_time_layer_stack", "_time_quant", "_quant_timer"):
        monkeypatch.setattr(precision, name, no_timing)
    monkeypatch.setattr(precision, "_xla_dots_off_level", lambda: "avx2 on an AVX-512 CPU")
    monkeypatch.setattr(precision, "_bf16_kernel_available", lambda: True)
    monkeypatch.setattr(small_bf16, "available", lambda: True)
    choice = precision.choose_compute_dtype(64, 128, str(tmp_path), bf16_kernel=True)
    assert choice.dtype == "bfloat16" and "avx2 on an AVX-512 CPU" in choice.describe()
    assert precision.choose_small_matmul(64, 128, 2, str(tmp_path)) == \
        precision.SMALL_MATMUL_ROWS[-1]
    from pallas_kernels.matmul import quant
    monkeypatch.setattr(quant, "available", lambda *a, **k: True)
    assert precision.choose_bf16_route({(512, 2048)}, str(tmp_path)) == {}


def test_auto_is_bf16_on_an_accelerator_untimed(tmp_path, monkeypatch):
    """On a GPU (or TPU) `auto` is bfloat16 without timing anything (XLA's f32 dot there runs
    TF32 at twice the weight bytes); on CPU the same call measures."""
    def never(*a, **k):
        raise AssertionError("timed on an accelerator")

    monkeypatch.setattr(precision, "_time_matmuls", never)
    monkeypatch.setattr(precision, "_time_bf16_rows", never)
    for backend in ("gpu", "tpu"):
        monkeypatch.setattr(precision, "_backend", lambda b=backend: b)
        choice = precision.choose_compute_dtype(4096, 14336, str(tmp_path), bf16_kernel=True)
        assert choice.dtype == "bfloat16" and choice.gflops == {}
        assert choice.source.startswith(f"{backend}: bf16")
    monkeypatch.setattr(precision, "_backend", lambda: "cpu")
    with pytest.raises(AssertionError, match="timed on an accelerator"):
        precision.choose_compute_dtype(64, 128, str(tmp_path))


def test_the_dtype_measurement_times_the_mlp_a_moe_only_model_has():
    """A Qwen3.5-MoE GGUF has no dense intermediate_size (0): the measurement times an
    expert's width (a [hidden, 0] matmul divided by zero at start-up)."""
    import dataclasses as dc

    from jaxbatch.model.arch import ModelArch
    from jaxbatch.tuning.startup import mlp_width

    base = ModelArch(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=96,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
                     rope_theta=1e4, max_position_embeddings=128, tie_word_embeddings=True,
                     attention_bias=False)
    assert mlp_width(base) == 96
    moe = dc.replace(base, intermediate_size=0, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=48, shared_expert_intermediate_size=40)
    assert mlp_width(moe) == 48
    assert mlp_width(dc.replace(moe, moe_intermediate_size=0)) == 40
