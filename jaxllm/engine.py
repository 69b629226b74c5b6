"""The engine: a loaded model plus the compiled prefill / decode-loop / forward functions."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import generate as gen, kernels
from . import prefill_chunked as chunked
from .cache import init_cache
from .config import ModelConfig
from .errors import RequestError
from .kv_plan import check_fits, plan_cache
from .model import forward, logits_from_hidden
from .sampling import SamplingParams
from .sharding import single_device_layout
from .split_cache import KVOptions, choose_layout, make_cache

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str                 # "stop" (EOS or a stop string) | "length"
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class GenerateStats:
    batch: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0


def bucket(n: int, lo: int = 16) -> int:
    """Next power of two >= n: prompt and cache lengths come in few shapes, so few compiles."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def check_sampling(max_tokens, temperature, top_k, top_p):
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if temperature is None or not np.isfinite(temperature) or temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise RequestError(f"top_k must be a non-negative integer, got {top_k!r}")
    if top_p is not None and not (0 < top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1], got {top_p!r}")


class Engine:
    def __init__(self, cfg: ModelConfig, weights, tokenizer, *, dtype="bfloat16", max_ctx=8192,
                 name="model", quant="none", layout=None, kv_quant="auto",
                 kv_options: KVOptions | None = None):
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.layout = layout or single_device_layout()   # weights must already lie on its mesh
        self._cache_makers = {}
        self.dtype_name, self.dtype = dtype, DTYPES[dtype]
        self.max_ctx, self.name, self.quant = max_ctx, name, quant
        self.kv_options = kv_options or KVOptions()
        self.kv_layout = choose_layout(kv_quant, max_ctx, self.kv_options)
        if max_ctx > cfg.max_position:
            warnings.warn(f"max_ctx {max_ctx} is beyond the model's trained context of {cfg.max_position} "
                          f"tokens; output quality past it is not guaranteed", stacklevel=2)
        check_fits(self.kv_plan(1))
        self.stats = GenerateStats()
        d = self.dtype
        jit = self._jit
        self._prefill = jit(partial(gen.prefill, cfg, dtype=d), static_argnames=("n_out",),
                                donate_argnames=("cache",))
        self._loop = jit(partial(gen.decode_loop, cfg, dtype=d), donate_argnames=("state",))
        self._step = jit(partial(gen.decode_step, cfg, dtype=d), donate_argnames=("cache",))
        self._forward = jit(self._forward_logits)
        self._chunk = jit(partial(chunked.prefill_chunk, cfg, dtype=d),
                              static_argnames=("mark_padding",), donate_argnames=("cache",))
        self._chunk_logits = jit(partial(chunked.logits_chunk, cfg, dtype=d),
                                     static_argnames=("mark_padding",), donate_argnames=("cache",))
        self._begin = jit(partial(gen.begin_decode, cfg), static_argnames=("n_out",))

    def _jit(self, fn, **kw):
        """jax.jit, traced with this engine's layout declared, so that the decode kernels know the
        mesh the weights lie on (see `jaxllm.kernels`)."""
        compiled = jax.jit(fn, **kw)
        layout = self.layout

        def call(*args, **kwargs):
            with kernels.use_layout(layout):
                return compiled(*args, **kwargs)
        return call

    # -- full forward ----------------------------------------------------------------------------
    def _forward_logits(self, weights, tokens):
        B, T = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        h, _ = forward(self.cfg, weights, tokens, pos, init_cache(self.cfg, B, T, self.dtype), self.dtype)
        return logits_from_hidden(self.cfg, weights, h)

    def logits(self, token_ids, lengths=None) -> np.ndarray:
        """Causal logits [B, T, vocab] (float32) of right-padded rows; past lengths[b] undefined."""
        ids = np.asarray(token_ids, np.int32)
        if ids.ndim != 2:
            raise RequestError(f"token_ids must be 2-D (batch, time), got shape {ids.shape}")
        B, T = ids.shape
        if T > self.max_ctx:
            raise RequestError(f"sequence of {T} tokens is longer than max_ctx {self.max_ctx}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise RequestError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        if self.kv_layout.split or T > self.kv_options.prefill_chunk:
            return self._chunked_logits(ids, lengths)
        Tb = min(bucket(T), max(self.max_ctx, T))
        padded = np.full((B, Tb), self.cfg.pad_id, np.int32)
        padded[:, :T] = ids
        lay = self.layout
        return lay.get(self._forward(self.weights, lay.put(padded, lay.batch_sharding(padded.shape))))[:, :T]

    # -- generation ------------------------------------------------------------------------------
    def encode_prompt(self, prompt, chat: bool) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this model directory has no tokenizer.json; pass token ids instead")
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            return self.tokenizer.encode_chat(list(prompt))
        if not isinstance(prompt, str):
            raise RequestError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        if chat and self.tokenizer.chat_template:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(self, prompts, max_tokens=64, temperature=0.0, top_k=None, top_p=None, seed=0,
                 stop=None, chat=True) -> list[Completion]:
        check_sampling(max_tokens, temperature, top_k, top_p)
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise RequestError("no prompts given")
        ids = [self.encode_prompt(p, chat) for p in prompts]
        return self.generate_ids(ids, max_tokens, temperature, top_k, top_p, seed, stop)

    def generate_ids(self, ids: list[list[int]], max_tokens=64, temperature=0.0, top_k=None,
                     top_p=None, seed=0, stop=None) -> list[Completion]:
        check_sampling(max_tokens, temperature, top_k, top_p)
        lens = [len(x) for x in ids]
        if min(lens) == 0:
            raise RequestError("a prompt encoded to no tokens")
        if max(lens) > self.max_ctx - 1:
            raise RequestError(f"prompt of {max(lens)} tokens does not fit max_ctx {self.max_ctx} "
                               f"(it needs room for at least one new token)")
        B, T = len(ids), min(bucket(max(lens)), self.max_ctx)
        S = min(bucket(max(lens) + max_tokens), self.max_ctx)
        row_max = np.array([min(max_tokens, S - n) for n in lens], np.int32)
        n_out = min(bucket(int(row_max.max()), 1), S)
        C = self.kv_options.prefill_chunk
        in_chunks = self.kv_layout.split or max(lens) > C
        if in_chunks:
            C, T = self._chunking(max(lens))
        check_fits(self.kv_plan(B, max(S, T)))
        tokens = chunked.pad_rows(ids, T, self.cfg.pad_id)
        put = self._put_rows
        params = jax.tree_util.tree_map(put, SamplingParams.make(B, temperature, top_k, top_p, seed))
        t0 = time.perf_counter()
        cache = self.new_cache(B, max(S, T))
        if in_chunks:
            cache, h_last = chunked.run_prefill(self._chunk, self.weights, tokens, lens, cache, C,
                                                self.cfg.hidden_size, self.dtype, self.kv_layout.split)
            state, _ = self._begin(self.weights, h_last, put(np.asarray(lens, np.int32)), cache, params,
                                   put(row_max), n_out=n_out)
        else:
            state, _ = self._prefill(self.weights, put(tokens), put(np.asarray(lens, np.int32)),
                                     cache, params, put(row_max), n_out=n_out)
        state.tokens.block_until_ready()
        t1 = time.perf_counter()
        state = self._loop(self.weights, state, params)
        out, n_new = self.layout.get(state.tokens), self.layout.get(state.n_new)
        t2 = time.perf_counter()
        self.stats = GenerateStats(B, sum(lens), int(n_new.sum()), t1 - t0, t2 - t1, int(state.step))
        return [self._finish(ids[b], out[b, :n_new[b]].tolist(), int(row_max[b]), stop) for b in range(B)]

    def _finish(self, prompt_ids, new_ids, limit, stop) -> Completion:
        reason = "length"
        if new_ids and new_ids[-1] in self.cfg.eos_ids:
            new_ids, reason = new_ids[:-1], "stop"
        text = self.tokenizer.decode(new_ids) if self.tokenizer is not None else ""
        for s in ([stop] if isinstance(stop, str) else stop or []):
            i = text.find(s) if s else -1
            if i >= 0:
                text, reason = text[:i], "stop"
                new_ids = _ids_covering(self.tokenizer, new_ids, text)
        return Completion(text, new_ids, reason, list(prompt_ids))

    def perplexity(self, text: str, window: int = 2048, stride: int | None = None):
        """Sliding-window perplexity of `text` -> PerplexityResult (.ppl .nll .num_scored_tokens)."""
        from .harness.perplexity import perplexity
        return perplexity(self, text, window, stride)

    # -- one step at a time (tests, and the server's continuous batching) ------------------------
    def new_cache(self, batch: int, length: int):
        """A zeroed cache laid out on the mesh: batch over "data", KV heads over "model"."""
        key = (batch, length)
        if key not in self._cache_makers:        # one compiled allocator per cache shape
            make = partial(make_cache, self.cfg, self.kv_layout, self.kv_options, batch, length, self.dtype)
            self._cache_makers[key] = jax.jit(make, out_shardings=self.layout.cache_shardings(jax.eval_shape(make)))
        return self._cache_makers[key]()

    def _put_rows(self, x):
        """Per-row host data -> a global array split over the data axis like the cache rows."""
        x = np.asarray(x)
        return self.layout.put(x, self.layout.batch_sharding(x.shape))

    def kv_plan(self, batch: int, length: int | None = None):
        """What a cache of `batch` rows and `length` (default max_ctx) positions takes."""
        return plan_cache(self.cfg, self.kv_layout, self.kv_options, batch, length or self.max_ctx,
                          self.dtype)

    # -- long prompts --------------------------------------------------------------------------
    def _chunking(self, longest: int) -> tuple[int, int]:
        """(chunk size, padded length): short prompts use their power-of-two bucket as the chunk,
        so they compile one small shape; the padded length is whole chunks. (Rings that other layers
        read hold window + prefill_chunk - 1 slots, so no chunk is too long for them.)"""
        C = min(self.kv_options.prefill_chunk, bucket(longest))
        return C, -(-longest // C) * C

    def _chunked_logits(self, ids: np.ndarray, lengths=None) -> np.ndarray:
        B, T = ids.shape
        C, Tp = self._chunking(T)
        lens = np.full((B,), T, np.int32) if lengths is None else np.asarray(lengths, np.int32)
        tokens = chunked.pad_rows(list(ids), Tp, self.cfg.pad_id)
        out, _ = chunked.run_logits(self._chunk_logits, self.weights, tokens, lens, self.new_cache(B, Tp),
                                    C, self.kv_layout.split)
        return np.concatenate(out, axis=1)[:, :T]

    def step(self, tokens, positions, cache):
        """One decode step for every row: tokens/positions [B] -> (logits [B, V], cache)."""
        return self._step(self.weights, self._put_rows(np.asarray(tokens, np.int32)),
                          self._put_rows(np.asarray(positions, np.int32)), cache)


def _ids_covering(tok, ids, text):
    """The shortest prefix of ids whose decoding covers `text` (stop strings cut mid-token)."""
    for n in range(len(ids) + 1):
        if len(tok.decode(ids[:n])) >= len(text):
            return ids[:n]
    return ids
