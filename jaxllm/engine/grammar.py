"""Structured output on the engine's side: a request's place in its grammar (`Matcher`, which takes
each token the request samples) and the token masks of a decode step's rows, computed together
by llguidance (grammars are compiled from a request's fields by the server, `serve.grammar`)."""

from __future__ import annotations

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, m: llguidance.LLMatcher, base: np.ndarray, words: int):
        self.m, self.base = m, base
        self.words = words  # of llguidance's masks: the tokenizer's ids, in 32s

    def follow(self, tokens: list[int]) -> tuple[int, bool]:
        """Take a request's new tokens in order -> (how many of them the answer keeps: up to the one
        that completed the grammar, whether one did). A token the grammar refuses (the mask allowed
        it, so the device and the matcher disagree) raises ValueError."""
        for i, t in enumerate(tokens):
            if not self.m.consume_token(int(t)):
                raise ValueError(f"the grammar refused token {t}: {self.m.get_error()}")
            if self.m.is_stopped():  # complete: it can take nothing more (EOS, once taken, included)
                return i + 1, True
        return len(tokens), False

    def copy(self) -> "Matcher":
        """Another matcher at the same place (each of a request's n answers follows its own)."""
        return Matcher(self.m.deep_copy(), self.base, self.words)


_executor: llguidance.LLExecutor | None = None


def masks(matchers: list[Matcher | None], words: int) -> np.ndarray:
    """[len(matchers), words] uint32: the tokens each matcher allows next, every token where None
    (a free row gets its logits back exactly). The constrained rows are computed together on
    llguidance's own threads, without the GIL."""
    global _executor
    out = np.full((len(matchers), words), 0xFFFFFFFF, np.uint32)
    live = [(i, m) for i, m in enumerate(matchers) if m is not None]
    if not live:
        return out
    if _executor is None:
        _executor = llguidance.LLExecutor()
    bits = np.zeros((len(matchers), live[0][1].words), np.int32)
    fill_next_token_bitmask_par(_executor, [(m.m, i) for i, m in live], bits)
    for i, m in live:
        n = min(bits.shape[1], words)
        np.bitwise_and(bits[i, :n].view(np.uint32), m.base[:n], out=out[i, :n])
        out[i, n:] = 0
    return out
