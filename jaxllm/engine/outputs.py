"""What generation returns: a `Completion` per answer, with each token's `TokenLogprob` when asked."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop token id or a stop string) | "length"
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (log_softmax of its raw logits, before temperature
    and top-k/top-p) and the `logprobs` most likely tokens at that position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(lp, row: int, ids: list[int], top: int) -> list[TokenLogprob]:
    """Tokens `ids` of row `row` of host LogProbs [B, S], with `top` alternatives each."""
    return [
        TokenLogprob(
            t,
            float(lp.token[row, i]),
            [
                (a, v)
                for a, v in zip(lp.top_ids[row, i, :top].tolist(), lp.top[row, i, :top].tolist())
                if v != float("-inf")
            ],
        )
        for i, t in enumerate(ids)
    ]


@dataclass
class GenerateStats:
    batch: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0  # decode steps after the first token
    compile_s: float = 0.0  # compiling the calls this run needed (not part of ttft_s or decode_s)
    spec: dict | None = None  # speculation: verify cycles, tokens drafted and accepted, summed over rows

    def spec_summary(self) -> str:
        if not self.spec:
            return ""
        c, d, a = self.spec["cycles"], self.spec["drafted"], self.spec["accepted"]
        return (
            f"; speculation: {a}/{d} drafts accepted ({a / max(d, 1):.0%}), "
            f"{(a + c) / max(c, 1):.2f} tokens a verify cycle"
        )
