"""The bucket sets that need no workload: pow2, linear:STEP, fixed:[...] (host only, no jax)."""

from __future__ import annotations

import pytest

from jaxbatch.planner.buckets import (
    Bucket,
    bucket_set,
    linear_buckets,
    parse_fixed,
    pow2_buckets,
    set_name,
)


def test_pow2_and_linear_grids():
    pow2 = pow2_buckets(512, 64)
    assert len(pow2) == 39 and pow2[0] == Bucket(16, 1) and pow2[-1] == Bucket(512, 64)
    assert all(b.num_seqs <= b.num_tokens for b in pow2)
    assert {b.num_tokens for b in pow2} == {16, 32, 64, 128, 256, 512}
    assert len(linear_buckets(512, 64, 16)) == 220
    assert {b.num_tokens for b in linear_buckets(40, 4, 16)} == {16, 32, 40}  # the limit is last
    assert pow2_buckets(8, 4) == [Bucket(8, 1), Bucket(8, 2), Bucket(8, 4)]
    with pytest.raises(ValueError, match="STEP >= 1"):
        linear_buckets(64, 8, 0)


def test_fixed_spellings():
    assert parse_fixed("[(32,4),(8,4)]", 64) == [Bucket(32, 4), Bucket(8, 4)]
    assert parse_fixed("16,128", 64) == [Bucket(16, 16), Bucket(128, 64)]
    assert parse_fixed("32", 8) == [Bucket(32, 8)]
    for bad in ("[(0,4)]", "[]", "nonsense"):
        with pytest.raises(ValueError, match="fixed:"):
            parse_fixed(bad, 8)


def test_bucket_set_specs():
    assert bucket_set("pow2", 512, 64) == pow2_buckets(512, 64)
    assert bucket_set("linear:16", 512, 64) == linear_buckets(512, 64, 16)
    assert bucket_set("fixed:[(8,8),(64,8)]", 64, 8) == [Bucket(8, 8), Bucket(64, 8)]
    assert [set_name(s) for s in ("pow2", "linear:16", "fixed:[(8,8)]")] == [
        "pow2", "linear:16", "fixed"]
    with pytest.raises(ValueError, match="unknown bucket set"):
        bucket_set("pow3", 64, 8)
