"""The step's model inputs packed into one int32 array and unpacked inside jit give back every
leaf's values, shapes and dtypes (the executables take the packed form)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxbatch.model.archs.llama import AttentionInputs
from jaxbatch.planner import Bucket
from jaxbatch.worker import packed_inputs
from jaxbatch.worker.step_inputs import dummy_step_inputs


def test_pack_unpack_round_trip_inside_jit():
    rng = np.random.default_rng(0)
    host = packed_inputs.ModelInputs(
        token_ids=rng.integers(0, 49152, 7, dtype=np.int32),
        positions=rng.integers(0, 2048, 7, dtype=np.int32),
        attn=AttentionInputs(rng.integers(-5, 9, 7, dtype=np.int32),
                             rng.integers(0, 99, 3, dtype=np.int32),
                             rng.integers(0, 64, (3, 5), dtype=np.int32),
                             np.array([0, 2, 5, 7], np.int32), np.array([3], np.int32)),
        # a float leaf too: bitcast, not converted (-0.0, NaN bits and subnormals survive)
        logits_indices=np.array([-0.0, np.nan, 1e-40], np.float32),
        lora_ids=rng.integers(0, 4, 7, dtype=np.int32))
    layout = packed_inputs.layout_of(host)
    flat = packed_inputs.pack(host)
    words = 7 + 7 + 7 + 3 + 15 + 4 + 1 + 3 + 7  # every leaf's elements
    assert flat.dtype == np.int32 and flat.shape == (layout.words,) == (words,)
    back = jax.jit(packed_inputs.unpack, static_argnums=1)(jnp.asarray(flat), layout)
    for want, got in zip(jax.tree.leaves(host), jax.tree.leaves(back), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.int32), want.view(np.int32))


def test_layout_follows_the_bucket_and_refuses_other_widths():
    a = packed_inputs.model_inputs(dummy_step_inputs(Bucket(16, 4), 8, 100))
    b = packed_inputs.model_inputs(dummy_step_inputs(Bucket(16, 4), 8, 100))
    assert packed_inputs.layout_of(a) == packed_inputs.layout_of(b)
    assert hash(packed_inputs.layout_of(a)) == hash(packed_inputs.layout_of(b))
    bad = packed_inputs.ModelInputs(np.zeros(2, np.int64), a.positions, a.attn, a.logits_indices,
                                    a.lora_ids)
    try:
        packed_inputs.layout_of(bad)
    except TypeError as e:
        assert "4-byte" in str(e)
    else:
        raise AssertionError("an int64 leaf was packed")
