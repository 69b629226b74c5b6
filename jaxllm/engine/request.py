"""A generation request as the engine's scheduler takes it: the prompt's token ids, how to sample,
when to stop and what to report. The server's requests extend it with what only HTTP needs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from jaxllm.errors import RequestError

SEED_MOD = 2**32
MAX_LOGIT_BIAS = 300  # logit_bias entries a row may have (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 16  # stop_token_ids a row may have
MAX_LOGPROBS = 20  # top alternatives a token may report (OpenAI's limit)


def check_sampling(max_tokens, temperature, top_k, top_p, min_p=0.0):
    """Sampling values a request may ask for (no JAX here: front ends check their flags with it
    before JAX loads)."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if temperature is None or not math.isfinite(temperature) or temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise RequestError(f"top_k must be a non-negative integer, got {top_k!r}")
    if top_p is not None and not (0 < top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(min_p, (int, float)) or isinstance(min_p, bool) or not 0 <= min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1], got {min_p!r}")


def check_logprobs(logprobs) -> int:
    """-> the number of alternatives the core computes (0: none) for `logprobs` None or 0..20."""
    if logprobs is None:
        return 0
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {logprobs!r}")
    return MAX_LOGPROBS  # one compiled variant for every count; rows take what they asked


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise RequestError(f"seed must be an integer, got {seed!r}")
    return int(seed)


def check_penalties(presence, frequency, repetition) -> tuple[float, float, float]:
    for name, v in (
        ("presence_penalty", presence),
        ("frequency_penalty", frequency),
        ("repetition_penalty", repetition),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise RequestError(f"{name} must be a finite number, got {v!r}")
    if repetition <= 0:
        raise RequestError(f"repetition_penalty must be > 0, got {repetition!r}")
    return float(presence), float(frequency), float(repetition)


def check_rules(logit_bias, stop_token_ids, min_tokens, max_tokens: int, vocab: int):
    """-> (logit_bias {id: bias}, stop token ids) checked (see `sampling.TokenRules`)."""
    bias = dict(logit_bias or {})
    stops = list(dict.fromkeys(stop_token_ids or []))
    for t in [*bias, *stops]:
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
            raise RequestError(f"token ids in logit_bias and stop_token_ids must lie in [0, {vocab}), got {t!r}")
    if len(bias) > MAX_LOGIT_BIAS or len(stops) > MAX_STOP_TOKEN_IDS:
        raise RequestError(
            f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens and stop_token_ids at most {MAX_STOP_TOKEN_IDS}"
        )
    if not all(isinstance(v, (int, float)) and np.isfinite(v) for v in bias.values()):
        raise RequestError("logit_bias values must be finite numbers")
    if not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
        raise RequestError(f"min_tokens must be an integer from 0 to max_tokens ({max_tokens}), got {min_tokens!r}")
    return bias, stops


def nth_seed(seed: int, i: int) -> int:
    """The seed the i-th answer drawn under `seed` samples with: seed + i (modulo 2**32). Choice i
    of a request and row i of an `Engine.generate` call both take it, so one seed reproduces every
    answer and no two answers of one call draw the same noise."""
    return (seed + i) % SEED_MOD


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
    skip_special: bool = True  # special tokens are left out of the text
    logprobs: int | None = None  # alternatives listed per token (None: no log-probabilities)
    echo: bool = False  # the answer starts with the prompt (its scores, with logprobs)
    n: int = 1  # answers to the prompt (choice i samples with seed + i)
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    min_p: float = 0.0  # tokens below min_p times the likeliest one's probability are dropped
    prompt_logprobs: int | None = None  # the prompt's tokens scored, with this many alternatives each
    include_stop: bool = False  # a stop string that ends the text stays in it

    def __post_init__(self):
        if self.echo and self.logprobs is not None:  # an echo with log-probabilities scores its prompt
            self.prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)

    def choice_seed(self, i: int) -> int:
        """The seed choice i samples with: the request's seed + i (`nth_seed`)."""
        return nth_seed(self.seed, i)

    @property
    def scores_prompt(self) -> bool:
        """The prompt's own tokens are scored (`prompt_logprobs`, or an echo with log-probabilities)."""
        return self.prompt_logprobs is not None
