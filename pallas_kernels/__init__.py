"""jaxbatch's kernels, by what they compute; each kernel ships a pure-jnp reference with its
signature, and tests compare them.

| package | kernel | language | platform |
|---|---|---|---|
| `attention/` | ragged paged attention: `reference.py` (jnp, any device), `kernel.py` (Pallas on the Triton backend: GPU; `interpret=True` on CPU for tests), `cpu.py` + `cpu_attention.cc` | jnp / Pallas / C++ | any / GPU / CPU |
| `matmul/` | the small bf16 matmul for decode steps: `small_bf16.py` + `small_bf16.cc` (AVX2: `small_bf16_avx2.cc`, aarch64: `small_bf16_neon.cc`); matmuls over GGUF blocks: `quant.py` + `quant.cc`, `quant_int8.cc` | C++ (AVX512-BF16 / VNNI, AVX2, NEON) | CPU |
| `deltanet/` | the Gated DeltaNet delta rule of a step on the state cache in place: `cpu.py` + `cpu_deltanet.cc` (jnp forms and spec: jaxbatch/model/archs/deltanet.py) | C++ (AVX-512, AVX2, portable) | CPU |
| `zeros.py` + `zeros.cc` | a zero-filled buffer (the KV cache) whose pages are not touched until written | C++ | CPU |

The C++ kernels are XLA FFI custom calls, built on the machine that runs them (with -march=native)
into one shared library and registered by `cpu_library.py`.
"""
