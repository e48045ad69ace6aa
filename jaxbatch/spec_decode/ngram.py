"""N-gram (prompt lookup) proposals for speculative decoding (host only: never imports jax).

The proposal for a sequence's next tokens is what followed the most recent earlier occurrence of
its last n tokens, trying n = max_n down to min_n (the longest match wins: vLLM's and llama.cpp's
prompt-lookup rule; among occurrences of that n-gram the latest, as the text being copied is
usually the nearest one). Proposals are deterministic, so verification treats them as a one-hot
draft distribution (spec_decode/speculation.py).

`NgramIndex` keeps, per n, a dict from each n-gram of the sequence to where its latest
occurrence ends, grown as tokens are appended (tokens are never removed), so a step costs
O(new tokens x n) per request rather than a scan of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        # n -> {n-gram: index of the token right after its latest indexed occurrence}
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (min_n..max_n long) seen before; [] when no suffix occurred before."""
        L = len(tokens)
        # index every n-gram that ends before the last token (the suffix itself must not match)
        for end in range(max(self.indexed, self.min_n), L):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[n][tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, L)
        if k <= 0:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            at = self.ends[n].get(tuple(tokens[L - n :]))
            if at is not None:
                return list(tokens[at : at + k])
        return []
