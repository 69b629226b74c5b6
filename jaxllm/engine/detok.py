"""Incremental detokenization with stop strings.

Each new token's text is the difference between decoding a short window of recent ids with and
without it (the window keeps the previous token as context, so decoders that strip a leading space
or join byte pieces see what a whole decode would see), which keeps the cost per token constant.
Text ending in U+FFFD (a character whose bytes have not all arrived) waits for the next token, and a
tail that could be the start of a stop string is held back, so neither a split character nor part of
a stop string ever reaches the client. `Engine.generate` cuts its answers with the same stream.

`settled()` tells how many tokens the sent text accounts for, so that their log-probabilities go
out with it: a token whose text is held back waits with it, and after a stop string only the tokens
that cover the text up to it count (those `Engine.generate` returns).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special: bool = True, include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.include_stop = include_stop  # the text ends after the stop string found, not before it
        self.skip_special = skip_special  # False: special tokens (a family's tool-call markers) are text
        self.ids: list[int] = []
        self.ends: list[int] = []  # for ids[:len(ends)]: the length of the text up to each one
        self.prefix = 0  # ids[prefix:read] were decoded already: the window's context
        self.read = 0
        self.text = ""  # text of ids[:read]
        self.sent = 0  # characters of self.text already emitted
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one generated token; returns the text that is now safe to emit (maybe empty).
        After a stop string is found, `stopped` is set and the text ends just before it (after it
        with `include_stop`)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        new = self._window_text()
        if not new or new.endswith(REPLACEMENT):
            return ""  # no complete character yet
        self._extend(new, len(self.ids))
        if self.stopped:
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._partial_stop(self.text))

    def push_many(self, tokens: list[int]) -> tuple[str, int]:
        """Add a block of generated tokens -> (the text now safe to emit, how many of the tokens
        were taken: all of them unless a stop string ended the text first). Without stop strings
        the block is decoded at once, which is what a server reading a decode block back needs."""
        if self.stop:
            out = []
            for i, tok in enumerate(tokens):
                out.append(self.push(tok))
                if self.stopped:
                    return "".join(out), i + 1
            return "".join(out), len(tokens)
        if self.stopped or not tokens:
            return "", 0
        self.ids.extend(tokens)
        new = self._window_text()
        if new and not new.endswith(REPLACEMENT):
            self._extend(new, len(self.ids))
        return self._emit(len(self.text)), len(tokens)

    def finish(self) -> str:
        """The generation ended (EOS, length): everything left is final, held-back text included."""
        if not self.stopped:
            self._extend(self._window_text(), len(self.ids))
        return self._emit(len(self.text))

    def settled(self) -> int:
        """How many of the tokens have their text wholly sent (after a stop string: how many cover
        the text before it)."""
        if self.stopped:
            need = len(self.text)
            return next((i + 1 for i, e in enumerate(self.ends) if e >= need), len(self.ids)) if need else 0
        return sum(1 for e in self.ends if e <= self.sent)

    def _extend(self, new: str, read: int):
        self.text += new
        self.ends += [len(self.text)] * (read - len(self.ends))  # tokens whose text is now known
        self.prefix, self.read = self.read, read
        cut = self._find_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True

    def _window_text(self) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        # stand-in tokenizers (random-weight models) take only the ids
        return self.tokenizer.decode(ids) if self.skip_special else self.tokenizer.decode(ids, skip_special=False)

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : upto], upto
        return delta

    def _find_stop(self) -> int | None:
        if not self.stop:
            return None
        # a stop string can only begin inside the unsent tail (the sent text was checked already)
        start = max(0, self.sent - max(map(len, self.stop)))
        hits = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if not hits:
            return None
        at, n = min(hits, key=lambda h: (h[0], -h[1]))  # the first to start (the longest of those)
        return at + n if self.include_stop else at

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        last = text[-1:]
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s[n - 1] == last and text.endswith(s[:n]):  # cheap test first
                    best = n
                    break
        return best
