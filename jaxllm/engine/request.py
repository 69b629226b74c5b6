"""A generation request as the engine's scheduler takes it: the prompt's token ids, how to sample,
when to stop and what to report. The server's requests extend it with what only HTTP needs."""
from __future__ import annotations

from dataclasses import dataclass, field

SEED_MOD = 2 ** 32


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    id: str = ""
    skip_special: bool = True          # special tokens are left out of the text
    logprobs: int | None = None        # alternatives listed per token (None: no log-probabilities)
    echo: bool = False                 # the answer starts with the prompt (its scores, with logprobs)
    n: int = 1                         # answers to the prompt (choice i samples with seed + i)
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0

    def choice_seed(self, i: int) -> int:
        """The seed choice i samples with: the request's seed + i (modulo 2**32)."""
        return (self.seed + i) % SEED_MOD

    @property
    def prompt_logprobs(self) -> bool:
        """The prompt's own tokens are scored (an echo with log-probabilities)."""
        return self.echo and self.logprobs is not None
