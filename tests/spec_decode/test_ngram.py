"""N-gram proposals (spec_decode/ngram.py) against a brute-force scan, as a sequence grows."""

from __future__ import annotations

import numpy as np
import pytest

from jaxbatch.spec_decode.ngram import NgramIndex


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix (max_n down to min_n) that occurred before; what followed its latest
    earlier occurrence."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):  # occurrences ending before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("vocab,min_n,max_n,k", [(4, 1, 3, 3), (6, 2, 4, 5), (3, 3, 3, 1)])
def test_index_equals_brute_force_while_growing(vocab, min_n, max_n, k):
    rng = np.random.default_rng(vocab * 10 + max_n)
    idx = NgramIndex(min_n, max_n)
    tokens = [int(t) for t in rng.integers(0, vocab, 20)]
    found = 0
    while len(tokens) < 200:
        got = idx.propose(tokens, k)
        assert got == brute_force(tokens, k, min_n, max_n), len(tokens)
        found += bool(got)
        tokens += [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 4)))]
    assert found > 20  # small vocabularies repeat: most calls find a match


def test_copying_is_proposed_and_the_suffix_never_matches_itself():
    idx = NgramIndex(2, 4)
    text = [5, 6, 7, 8, 9, 10, 11]
    assert idx.propose(text + [1, 2], 3) == []  # no earlier occurrence of any suffix
    assert idx.propose(text + [1, 2, 5, 6], 4) == [7, 8, 9, 10]  # copying the text
    assert idx.propose(text + [1, 2, 5, 6], 0) == []
    assert NgramIndex(1, 2).propose([3], 2) == []  # a single token has nothing before it
