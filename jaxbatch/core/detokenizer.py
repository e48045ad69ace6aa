"""Incremental detokenisation and stop strings (host only).

Text is produced with the prefix/read-offset method: decode a short window of ids before and
after the newest token and emit the difference, holding back while the window ends in an
incomplete UTF-8 sequence (U+FFFD). The text therefore equals `tokenizer.decode(all output ids)`
for byte-level BPE tokenizers, without re-decoding the whole output every step.
Stop strings are found in the accumulated text and excluded (OpenAI semantics); while a stop
string could still be forming at the end, those characters are held back from streaming.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all decoded output text so far
        self.emitted = 0  # characters of `text` already handed out
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped_on: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token. Returns the matched stop string if one completed, else None.
        `check_stop=False` (min_tokens not reached yet) decodes without looking for stops."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start_search = max(0, len(self.text) - self.hold)
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            if self.stop and check_stop:
                return self._find_stop(start_search)
        return None

    def _find_stop(self, start: int) -> str | None:
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped_on = s
        return s

    def flush(self) -> None:
        """At the end: whatever is still buffered (e.g. a dangling partial character) is decoded."""
        if self.stopped_on is None and self._read_offset < len(self.ids):
            prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.ids[self._prefix_offset :])
            self.text += full[len(prefix) :]
            self._read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        """New text to stream. While not finished, hold back a possible partial stop string."""
        end = len(self.text) if finished or not self.stop else max(self.emitted,
                                                                    len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
