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


MAX_STOP_STRINGS = 16  # stop strings a request may have
MAX_STOP_CHARS = 512  # characters a stop string may have


def _bad(param: str, rule: str, value) -> RequestError:
    return RequestError(f"'{param}' {rule}, got {value!r}", param)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def check_sampling(max_tokens, temperature, top_k, top_p, min_p=0.0, empty_ok: bool = False):
    """Sampling values a request may ask for (no JAX here: front ends check their flags with it
    before JAX loads); `empty_ok`: max_tokens may be 0 (an echo that only scores its prompt)."""
    if not _is_int(max_tokens) or max_tokens < (0 if empty_ok else 1):
        raise _bad("max_tokens", "must be a positive integer", max_tokens)
    if not _is_num(temperature) or temperature < 0:
        raise _bad("temperature", "must be >= 0", temperature)
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise _bad("top_k", "must be a non-negative integer", top_k)
    if top_p is not None and not (_is_num(top_p) and 0 < top_p <= 1):
        raise _bad("top_p", "must be in (0, 1]", top_p)
    if not _is_num(min_p) or not 0 <= min_p <= 1:
        raise _bad("min_p", "must be in [0, 1]", min_p)


def check_logprobs(logprobs, param: str = "logprobs") -> int:
    """-> the number of alternatives the core computes (0: none) for `logprobs` None or 0..20."""
    if logprobs is None:
        return 0
    if not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS:
        raise _bad(param, f"must be an integer from 0 to {MAX_LOGPROBS}", logprobs)
    return MAX_LOGPROBS  # one compiled variant for every count; rows take what they asked


def check_seed(seed) -> int:
    if not _is_int(seed):
        raise _bad("seed", "must be an integer", seed)
    return int(seed)


def check_penalties(presence, frequency, repetition) -> tuple[float, float, float]:
    """OpenAI's presence and frequency penalties (in [-2, 2]) and vLLM's repetition penalty (> 0)."""
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not _is_num(v) or not -2 <= v <= 2:
            raise _bad(name, "must be in [-2, 2]", v)
    if not _is_num(repetition) or repetition <= 0:
        raise _bad("repetition_penalty", "must be > 0", repetition)
    return float(presence), float(frequency), float(repetition)


def check_rules(logit_bias, stop_token_ids, min_tokens, max_tokens: int, vocab: int):
    """-> (logit_bias {id: bias}, stop token ids) checked (see `sampling.TokenRules`)."""
    bias = dict(logit_bias or {})
    stops = list(dict.fromkeys(stop_token_ids or []))
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
    for t, v in bias.items():
        if not _is_int(t) or not 0 <= t < vocab:
            raise RequestError(f"'logit_bias' token {t!r} is outside the vocabulary [0, {vocab})", "logit_bias")
        if not _is_num(v) or not -100 <= v <= 100:
            raise RequestError(
                f"'logit_bias' values must be numbers in [-100, 100], got {v!r} for token {t}", "logit_bias"
            )
    if any(not _is_int(t) or not 0 <= t < vocab for t in stops):
        raise RequestError(f"token ids in 'stop_token_ids' must lie in [0, {vocab})", "stop_token_ids")
    if len(stops) > MAX_STOP_TOKEN_IDS:
        raise RequestError(
            f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} token ids, got {len(stops)}", "stop_token_ids"
        )
    if not _is_int(min_tokens) or min_tokens < 0:
        raise _bad("min_tokens", "must be a non-negative integer", min_tokens)
    if min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({min_tokens}) must not be more than max_tokens ({max_tokens})", "min_tokens")
    return {int(t): float(v) for t, v in bias.items()}, [int(t) for t in stops]


def check_stop(stop) -> list[str]:
    """Stop strings: a string or a list of them, each non-empty, at most MAX_STOP_STRINGS of at most
    MAX_STOP_CHARS characters; -> the list, each once."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop")
    if any(s == "" for s in items):
        raise RequestError("'stop' strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise RequestError(f"'stop' strings may have at most {MAX_STOP_CHARS} characters", "stop")
    return list(dict.fromkeys(items))


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

    def check(self, vocab_size: int) -> "Request":
        """Every value the request holds, checked once for every front end (`Engine.generate` and
        the server alike): a `RequestError` names the field at fault. -> the request."""
        check_sampling(self.max_tokens, self.temperature, self.top_k, self.top_p, self.min_p, empty_ok=self.echo)
        self.seed = check_seed(self.seed)
        check_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        self.logit_bias, self.stop_token_ids = check_rules(
            self.logit_bias, self.stop_token_ids, self.min_tokens, self.max_tokens, vocab_size
        )
        self.stop = check_stop(self.stop)
        check_logprobs(self.logprobs)
        check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", "must be a positive integer", self.n)
        return self

    def choice_seed(self, i: int) -> int:
        """The seed choice i samples with: the request's seed + i (`nth_seed`)."""
        return nth_seed(self.seed, i)

    @property
    def scores_prompt(self) -> bool:
        """The prompt's own tokens are scored (`prompt_logprobs`, or an echo with log-probabilities)."""
        return self.prompt_logprobs is not None
