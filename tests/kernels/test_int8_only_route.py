"""A kernel build with the quantised matmul's int8 mode but no float mode for the compute dtype
runs a GGUF's block weights through that mode in bfloat16 (llama.cpp's AVX2 scheme) instead of
dequantising them: every block weight goes to the kernel with act int8, and the logits are the
jnp path's within the int8 activations' rounding. No x86 level is such a build since the avx2
level has the float mode (quant_float_avx2.cc), so the float mode is reported missing here
(`quant.available` patched), and the route runs wherever the int8 mode is built; a build with
the float mode routes by its measured modes instead (tests/model/test_gguf.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType as QT

from jaxbatch.model.archs import llama
from jaxbatch.model.gguf import reader as model_gguf
from jaxbatch.model.quantize import QuantWeight
from pallas_kernels import cpu_library
from pallas_kernels.matmul import quant
from tests.helpers import gguf_files
from tests.helpers.prefill import prefill_logits
from tests.model.test_gguf import _K_COMMON, IDS, _tiny


@pytest.fixture(scope="module", autouse=True)
def _built(tmp_path_factory):
    why = cpu_library.available(str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    assert why is None, why
    if not quant.available(jnp.bfloat16, act="int8"):
        pytest.skip("this build has no int8 mode: the jnp path runs")


def _int8_only(monkeypatch):
    """This build as one with the int8 mode alone: the float mode reported missing."""
    has = quant.available
    monkeypatch.setattr(quant, "available",
                        lambda dtype, act="float": act != "float" and has(dtype, act))


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0"])
def test_block_weights_run_the_int8_mode(tmp_path, monkeypatch, fmt):
    _int8_only(monkeypatch)
    model = _tiny(transformers.LlamaConfig(**_K_COMMON, rope_theta=10000.0,
                                           tie_word_embeddings=True))
    path = gguf_files.write_gguf(str(tmp_path / "m.gguf"), model, qtype=lambda n, w: QT[fmt])
    arch, params, _ = model_gguf.load_gguf(path, jnp.bfloat16)
    on_cpu = llama.as_run_on_cpu(params, arch)
    kept = [w for w in on_cpu["layers"].values() if isinstance(w, QuantWeight)]
    assert kept and all(w.kernel and w.acts == ("int8",) * len(w.fmts) for w in kept)
    a = prefill_logits(arch, params, IDS, jnp.uint16)
    b = prefill_logits(arch, on_cpu, IDS, jnp.uint16)
    # int8 activations: ~1% relative error per matmul (llama.cpp's), a few matmuls deep
    np.testing.assert_allclose(b, a, atol=0.05 * np.abs(a).max())
    assert not np.array_equal(a, b)  # the int8 path ran, not the jnp one
