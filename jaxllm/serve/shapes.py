"""The shapes of the server's device calls, few enough to compile them all before serving."""
from __future__ import annotations

from dataclasses import dataclass


def ladder(cap: int, factor: int = 4) -> list[int]:
    """1, factor, factor**2, ... below cap, then cap."""
    out, n = [], 1
    while n < cap:
        out.append(n)
        n *= factor
    return out + [cap]


@dataclass(frozen=True)
class Shapes:
    """The shapes of the device calls, few enough to compile them all before serving (each is a
    trace and a compile). Prefill forwards [rows, tokens]: pieces of up to 128 tokens, several
    prompts' in one forward (rows 1, 2, 4, ... as the budget and the slots allow), or one longer
    piece of 512, 2048, ... tokens up to the longest piece. Decode blocks run over the leading 1, 4,
    16, ... slots, so a few live requests do not pay for every slot.

    Prefill rows go up by 2, not 4: requests that arrive a few at a time (answers that end at
    different lengths) would otherwise pay for up to four times their rows in each prefill, which
    every running request waits on."""
    budget: int           # tokens a prefill forward may take (--max-num-batched-tokens)
    slots: int
    max_piece: int        # the longest piece of one prompt in a forward
    short: int = 128

    def lengths(self) -> list[int]:
        out = [min(self.short, self.max_piece)]
        while out[-1] * 4 < self.max_piece:
            out.append(out[-1] * 4)
        return out + ([self.max_piece] if out[-1] < self.max_piece else [])

    def row_counts(self, C: int) -> list[int]:
        if C != self.lengths()[0]:
            return [1]
        return ladder(max(1, min(self.slots, self.budget // C)), factor=2)

    def prefills(self) -> list[tuple[int, int]]:
        return [(P, C) for C in self.lengths() for P in self.row_counts(C)]

    def decodes(self) -> list[int]:
        return ladder(self.slots)

    def decode_rows(self, live: int) -> int:
        """The leading slots a decode block covers when slots below `live` are in use."""
        return next(n for n in self.decodes() if n >= live)

    def choose(self, remaining: list[int]) -> tuple[int, int, list[int]]:
        """For prompts waiting with `remaining` tokens each (in admission order): (P, C, the piece
        length of each prompt taken, in order). The first prompt sets the piece length; short
        pieces take the next prompts along while rows are left, each with at most C tokens."""
        C = next(c for c in self.lengths() if c >= min(remaining[0], self.max_piece))
        pieces = [min(r, C) for r in remaining[:self.row_counts(C)[-1]]]
        P = next(p for p in self.row_counts(C) if p >= len(pieces))
        return P, C, pieces
