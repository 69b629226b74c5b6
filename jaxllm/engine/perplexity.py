"""Sliding-window perplexity.

Protocol: the text is tokenized once, without BOS. Windows of W tokens, counting a fresh BOS at the
front of each, start every S text tokens; a window scores only the tokens no earlier window has
scored, the rest is context. PPL = exp(mean NLL over all scored tokens). With a BOS every text token
is scored (the first one from BOS alone), which is Hugging Face's sliding-window recipe with an
exact token count. A model without any BOS token uses windows of W text tokens and leaves the very
first token unscored.

A window scores at most W-1 tokens, so a stride above W-1 (S = W, "no overlap") is capped at W-1:
no token may fall between two windows unscored.

Windows run through the engine core (`core.prefill`, scoring): a batch of windows fills a cache of
its own rows and positions, in the prompt chunks the engine uses, so perplexity measures what the
engine computes under its KV policy. The NLL is computed on the device, a few rows at a time and
only at scored positions, so the [tokens, vocab] logits never exist whole and never reach the host.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from jaxllm.errors import RequestError

TOKENS_PER_FORWARD = 8192  # windows are batched up to this many tokens per forward
SCORE_BYTES = 2 << 30  # and while one layer's f32 attention scores stay under this


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean NLL per scored token (nats)
    num_scored_tokens: int
    window: int
    stride: int

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Window:
    begin: int  # first text token in the window
    end: int  # one past the last
    score_from: int  # text tokens [score_from, end) are scored here


def plan_windows(n: int, window: int, stride: int, has_bos: bool) -> list[Window]:
    """The windows covering n text tokens; every scorable token is scored exactly once."""
    span = window - 1 if has_bos else window
    step = min(stride, window - 1)  # without BOS a window's first token is context only
    out, begin, prev_end = [], 0, 0
    while True:
        end = min(begin + span, n)
        first = begin if has_bos else begin + 1
        out.append(Window(begin, end, max(prev_end, first)))
        prev_end = end
        if end >= n:
            return out
        begin += step


def check_window(window, stride) -> tuple[int, int]:
    """Validated (window, stride); stride defaults to window // 2."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise RequestError(f"perplexity window must be an integer >= 2, got {window!r}")
    if stride is None:
        stride = max(1, window // 2)
    if not isinstance(stride, int) or isinstance(stride, bool) or not 1 <= stride <= window:
        raise RequestError(f"perplexity stride must be an integer in [1, window={window}], got {stride!r}")
    return window, stride


# -- on device: the engine core's prefill, scoring ------------------------------------------------
def pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# -- host side ------------------------------------------------------------------------------------
def bos_id(engine) -> int | None:
    tok = engine.tokenizer
    if tok is not None and tok.bos_id is not None:
        return int(tok.bos_id)
    return None if engine.cfg.bos_id is None else int(engine.cfg.bos_id)


def perplexity_ids(engine, ids, window: int = 2048, stride: int | None = None, progress=None) -> PerplexityResult:
    """Perplexity of a token sequence (no BOS in `ids`) under the protocol above."""
    window, stride = check_window(window, stride)
    cfg = engine.cfg
    ids = np.asarray(ids, np.int32).reshape(-1)
    bos = bos_id(engine)
    if ids.size < (1 if bos is not None else 2):
        raise RequestError(f"the text is too short to score (it needs at least {1 if bos is not None else 2} token(s))")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise RequestError(f"token ids must lie in [0, {cfg.vocab_size})")
    wins = plan_windows(int(ids.size), window, stride, bos is not None)
    lead = 1 if bos is not None else 0
    T = max(w.end - w.begin for w in wins) + lead
    if T > cfg.max_position:
        raise RequestError(f"perplexity window {window} exceeds the model's {cfg.max_position} positions")
    heads = max(a.num_heads for a in cfg.attn if a is not None)
    B = max(1, min(len(wins), TOKENS_PER_FORWARD // T, SCORE_BYTES // (4 * heads * T * T)))
    C, Tp = engine.chunking(T)
    scorer = engine.core(B, Tp, span=C)  # every window starts at 0, so rows need no clearing between batches
    total, count = 0.0, 0
    for i in range(0, len(wins), B):
        tokens, scored = pack(wins[i : i + B], ids, B, Tp, bos, cfg.pad_id)
        lengths = np.asarray([min(w.end - w.begin + lead, T) for w in wins[i : i + B]] + [0] * B, np.int32)[:B]
        total += window_batch_nll(engine, scorer, tokens, scored, lengths, C)
        count += int(scored.sum())
        if progress:
            progress(min(i + B, len(wins)), len(wins))
    mean = total / count
    return PerplexityResult(math.exp(mean), mean, count, window, stride)


def window_batch_nll(engine, scorer, tokens: np.ndarray, scored: np.ndarray, lengths: np.ndarray, chunk: int) -> float:
    """Summed NLL of the scored tokens of a [B, T] window batch (token t predicted at t-1), chunk by
    chunk through the scorer's cache."""
    from jaxllm.engine.slots import Pieces  # JAX, only here: `check_window` serves front ends before it loads

    total = 0.0
    for s in range(0, tokens.shape[1], chunk):
        # token t is scored from the hidden state at t - 1, which may lie in the chunk before
        b, t = np.nonzero(scored[:, s + 1 : s + chunk + 1])
        t = t + s + 1
        n = pow2_at_least(max(len(b), 16))
        where = np.zeros(n, np.int32)
        targets = np.full(n, -1, np.int32)
        where[: len(b)] = b * chunk + (t - 1 - s)
        targets[: len(b)] = tokens[b, t]
        pieces = Pieces.make(tokens[:, s : s + chunk], s, np.clip(lengths - s, 0, chunk))
        nll = scorer.prefill(pieces, out="nll", targets=(where, targets))
        total += float(np.asarray(engine.layout.get(nll), np.float64)[: len(b)].sum())
    return total


def pack(wins: list[Window], ids: np.ndarray, B: int, T: int, bos, pad_id: int):
    """Right-padded [B, T] tokens and the scored mask; rows past len(wins) are all padding."""
    tokens = np.full((B, T), pad_id, np.int32)
    scored = np.zeros((B, T), bool)
    lead = 1 if bos is not None else 0
    for r, w in enumerate(wins):
        if lead:
            tokens[r, 0] = bos
        tokens[r, lead : lead + w.end - w.begin] = ids[w.begin : w.end]
        scored[r, lead + w.score_from - w.begin : lead + w.end - w.begin] = True
    return tokens, scored


def perplexity(engine, text: str, window: int = 2048, stride: int | None = None, progress=None) -> PerplexityResult:
    """Perplexity of `text`: tokenized once without BOS, then scored window by window."""
    if not isinstance(text, str):
        raise RequestError(f"perplexity text must be a string, got {type(text).__name__}")
    if engine.tokenizer is None:
        raise RequestError("this model has no tokenizer, so it cannot score text")
    if not text.strip():
        raise RequestError("the perplexity text is empty")
    ids = engine.tokenizer.encode(text, add_special=False)
    return perplexity_ids(engine, ids, window, stride, progress)


# -- command line ---------------------------------------------------------------------------------
