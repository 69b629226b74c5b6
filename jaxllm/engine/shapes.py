"""The shapes of the server's device calls, few enough to compile them all before serving, and
which one a prefill forward takes."""

from __future__ import annotations

from dataclasses import dataclass

# What a prefill forward costs beyond its tokens, counted in tokens: the weights it reads and its
# kernels' launches, whatever its rows. The Qwen3-4B shape on one H100 (int8) prefills 16 x 128
# tokens in 37.7 ms and 64 x 128 in 125 ms: 14.2 us a token and 8.6 ms a forward, about 600 tokens.
FORWARD_TOKENS = 512
# The piece length of a deterministic server's one prefill shape: prompts are cut every this many
# tokens from their start, alone or not.
DETERMINISTIC_PIECE = 256


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
    trace and a compile). Prefill forwards [rows, tokens]: pieces of 128, 512, 2048, ... tokens up
    to the longest piece, several prompts' in one forward (rows 1, 2, 4, ... as the budget and the
    slots allow). Decode blocks run over the leading 1, 4, 16, ... slots, so a few live requests do
    not pay for every slot.

    Prefill rows go up by 2, not 4: requests that arrive a few at a time (answers that end at
    different lengths) would otherwise pay for up to four times their rows in each prefill, which
    every running request waits on.

    `deterministic`: one shape of each kind, whatever the load, so that a request's tokens meet the
    same arithmetic alone or among others: prefill forwards of P pieces of DETERMINISTIC_PIECE
    tokens (P the rows an eighth of the budget holds: a lone short prompt pays for all of them),
    decode blocks over every slot."""

    budget: int  # tokens a prefill forward may take (--max-num-batched-tokens)
    slots: int
    max_piece: int  # the longest piece of one prompt in a forward
    short: int = 128
    deterministic: bool = False

    def lengths(self) -> list[int]:
        if self.deterministic:
            return [min(DETERMINISTIC_PIECE, self.max_piece)]
        out = [min(self.short, self.max_piece)]
        while out[-1] * 4 < self.max_piece:
            out.append(out[-1] * 4)
        return out + ([self.max_piece] if out[-1] < self.max_piece else [])

    def row_counts(self, C: int) -> list[int]:
        if self.deterministic:
            return [max(1, min(self.slots, self.budget // (8 * C)))]
        return ladder(max(1, min(self.slots, self.budget // C)), factor=2)

    def prefills(self) -> list[tuple[int, int]]:
        return [(P, C) for C in self.lengths() for P in self.row_counts(C)]

    def decodes(self) -> list[int]:
        return [self.slots] if self.deterministic else ladder(self.slots)

    def decode_rows(self, live: int) -> int:
        """The leading slots a decode block covers when slots below `live` are in use."""
        return next(n for n in self.decodes() if n >= live)

    def choose(self, remaining: list[int], compiled=None) -> tuple[int, int, list[int]]:
        """For prompts waiting with `remaining` tokens each (in admission order): (P, C, the piece
        length of each prompt taken, in order), the first P prompts taking at most C tokens each.

        Of the shapes (those `compiled(P, C)` allows, when given), the one that does the most
        prompt tokens for what it costs: P x C tokens and FORWARD_TOKENS for the forward, and
        FORWARD_TOKENS more where it leaves prompt tokens for another forward. So 33 prompts of 100
        tokens go as 32 rows and then 1, not as 64 rows of which 31 are padding; prompts of a few
        hundred tokens share forwards of 128- or 512-token pieces rather than each taking a
        forward of its own; one long prompt goes in the longest pieces. Ties go to the shape that
        does more. Prompts are taken in their order of arrival: one that waits behind a long
        prompt goes in once that prompt's last piece does, or along with a piece of it where that
        costs less than a forward of its own."""
        best = None
        for C in self.lengths():
            for P in self.row_counts(C):
                if compiled is not None and not compiled(P, C):
                    continue
                pieces = [min(r, C) for r in remaining[:P]]
                left = len(remaining) > P or any(r > C for r in remaining[:P])
                cost = P * C + FORWARD_TOKENS * (1 + left)
                key = (sum(pieces) / cost, sum(pieces))
                if best is None or key > best[0]:
                    best = key, (P, C, pieces)
        return best[1]
