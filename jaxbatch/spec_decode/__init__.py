"""Speculative decoding: the proposer interface and verification (speculation.py), the draft
model proposer (draft.py) and the n-gram index (ngram.py, host only)."""
