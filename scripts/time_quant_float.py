"""The quantised matmul's float mode against its int8 mode, its panel mode (BF16 rows: from the
rows and from packed panels, where the build has it) and XLA's dots, at llama-1b's shapes
(not a test): medians of repeats, the contenders taking turns within each repeat so that they
compare under the same load (a shared VM's drifts over seconds). Weight stacks of >= 600 MB, a
layer per call, so that decode reads its weights from memory.

  JAXBATCH_CPU_LEVEL=avx2 .venv/bin/python scripts/time_quant_float.py
  ... --shapes 2048x2048,8192x2048 --ms 1,512 --fmts BF16,Q4_K

Prints ms a call, GB/s of weight bytes (decode) and GFLOP/s; "xla f32": XLA's dot on f32
weights (what dtype float32 runs), "xla bf16": XLA's dot on bf16 weights.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant
from tests.kernels.test_quant_matmul import make_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmts", default="BF16,Q4_K,Q8_0")
    ap.add_argument("--shapes", default="2048x2048,8192x2048,512x2048,2048x8192", help="NxK")
    ap.add_argument("--ms", default="1,4,16,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stack-mb", type=int, default=600)
    a = ap.parse_args()
    why = cpu_library.available(os.path.join(tempfile.gettempdir(), "jaxbatch-quant-bench"))
    assert why is None, why
    print(f"level {cpu_library.cpu_level()}, load {os.getloadavg()}", flush=True)
    rng = np.random.default_rng(0)
    mm = jax.jit(quant.quant_matmul, static_argnames=("fmt", "k", "act"))

    @jax.jit
    def xla(x, w, li):
        return jnp.dot(x, w[li].T, preferred_element_type=jnp.float32).astype(x.dtype)

    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for m in (int(v) for v in a.ms.split(",")):
            runs = {}
            for fmt in a.fmts.split(","):
                rb = quant.row_bytes(fmt, k)
                L = max(2, a.stack_mb * 2**20 // (n * rb)) if m <= 16 else 2
                one = make_weight(fmt, n, k, rng)
                stack = jnp.asarray(np.broadcast_to(one, (L, n, rb)).copy())
                for dt in (jnp.bfloat16, jnp.float32):
                    x = jnp.asarray(rng.standard_normal((m, k)), dt)
                    runs[f"{fmt} float {jnp.dtype(dt).name}"] = (
                        lambda li, x=x, s=stack, f=fmt, k=k: mm(x, s, li, fmt=f, k=k), L, n * rb)
                if fmt in quant.INT8_FORMATS and quant.available(jnp.bfloat16, "int8"):
                    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
                    runs[f"{fmt} int8 bfloat16"] = (
                        lambda li, x=x, s=stack, f=fmt, k=k: mm(x, s, li, fmt=f, k=k,
                                                                act="int8"),
                        L, n * rb)
                if fmt == "BF16" and n % 16 == 0 and quant.available(jnp.bfloat16, "panel"):
                    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
                    for act, s in (("panel", stack), ("panel_packed", quant.pack_panels(stack))):
                        runs[f"BF16 {act} bfloat16"] = (
                            lambda li, x=x, s=s, k=k, act=act: mm(x, s, li, fmt="BF16", k=k,
                                                                  act=act),
                            L, n * rb)
            for dt in (jnp.float32, jnp.bfloat16):
                L = max(2, a.stack_mb * 2**20 // (n * k * jnp.dtype(dt).itemsize)) if m <= 16 \
                    else 2
                w = jnp.asarray(np.broadcast_to(
                    (rng.standard_normal((n, k)) * 0.05).astype(jnp.dtype(dt)), (L, n, k)).copy())
                x = jnp.asarray(rng.standard_normal((m, k)), dt)
                runs[f"xla {jnp.dtype(dt).name}"] = (lambda li, x=x, w=w: xla(x, w, li), L,
                                                     n * k * jnp.dtype(dt).itemsize)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for f, _, _ in runs.values():
                jax.block_until_ready(f(0))
            for _ in range(a.repeats):
                for name, (f, L, _) in runs.items():
                    calls = min(L, 40) if m <= 16 else 2
                    t0 = time.perf_counter()
                    for i in range(calls):
                        out = f(i % L)
                    jax.block_until_ready(out)
                    times[name].append((time.perf_counter() - t0) / calls)
            for name, (_, _, nbytes) in runs.items():
                t = float(np.median(times[name]))
                print(f"N={n} K={k} M={m:3d} {name:22s} {t * 1e3:8.3f} ms {nbytes / t / 1e9:6.1f} "
                      f"GB/s {2 * m * n * k / t / 1e9:7.1f} GFLOP/s", flush=True)
            del runs
    print(f"load {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
