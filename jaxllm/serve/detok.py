"""Incremental detokenization with stop strings.

The growing id list is decoded whole and only the stable new suffix is emitted: text ending in
U+FFFD (a character whose bytes have not all arrived) is held back, and so is any tail that could be
the start of a stop string, so that neither a split character nor part of a stop string ever reaches
the client. The concatenated deltas equal `Engine.generate`'s text for the same tokens.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0                  # characters of self.text already emitted
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one generated token; returns the text that is now safe to emit (maybe empty).
        After a stop string is found, `stopped` is set and the text ends just before it."""
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids)
        cut = self._find_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._emit(len(self.text))
        safe = len(self.text.rstrip(REPLACEMENT))
        safe -= self._partial_stop(self.text[:safe])
        return self._emit(safe)

    def finish(self) -> str:
        """The generation ended (EOS, length): everything left is final, held-back text included."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:upto], upto
        return delta

    def _find_stop(self) -> int | None:
        if not self.stop:
            return None
        # a stop string can only begin inside the unsent tail (the sent text was checked already)
        start = max(0, self.sent - max(map(len, self.stop)))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
