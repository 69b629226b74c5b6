"""The engine: a loaded model plus the compiled prefill / decode-loop / forward functions."""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import ops as backends
from jaxllm.compiling import compile_all, map_threads
from jaxllm.config.kv import KVOptions
from jaxllm.config.model import ModelConfig
from jaxllm.config.runtime import Caches, RuntimeConfig
from jaxllm.engine import batch, compilation_cache, core
from jaxllm.engine.compilation_cache import Compiles, enable, executables_folder
from jaxllm.engine.detok import TextStream
from jaxllm.engine.host import EngineCore, bucket, pad_rows
from jaxllm.engine.outputs import Completion, GenerateStats
from jaxllm.engine.perplexity import perplexity
from jaxllm.engine.request import (
    Request,
    check_logprobs,
    nth_seed,
)
from jaxllm.engine.slots import Slots, State
from jaxllm.engine.speculative import Speculation
from jaxllm.errors import ModelError, RequestError
from jaxllm.kv.options import choose_layout
from jaxllm.kv.paged import PagedCache, kind_specs, make_pools, static_tables
from jaxllm.kv.plan import PoolPlan, check_fits, device_stats, per_device_bytes
from jaxllm.model.sharding import single_device_layout

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
log = logging.getLogger("jaxllm")


class Engine:
    """A loaded model on its mesh, its KV policy, and the compiled calls of the engine core
    (`core.prefill`, `core.decode`, `core.fork`), which every front end drives through an `EngineCore`."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights,
        tokenizer,
        *,
        dtype="bfloat16",
        max_ctx: int | None = None,
        name="model",
        quant="none",
        layout=None,
        kv_quant="auto",
        kv_options: KVOptions | None = None,
        speculation: Speculation | None = None,
        draft_weights=None,
        runtime: RuntimeConfig | None = None,
        caches: Caches | None = None,
    ):
        """`caches.compilation`: the persistent compilation cache's folder (None: none): JAX's cache
        is pointed there, and the core's calls are kept there whole and read back."""
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.layout = layout or single_device_layout()  # weights must already lie on its mesh
        # The backend, chosen once: weights must be laid out for it (`ops.prepare_weights`).
        self.runtime = RuntimeConfig() if runtime is None else runtime
        self.ops = backends.select(self.runtime, self.layout)
        self._state_makers = {}
        self.dtype_name, self.dtype = dtype, DTYPES[dtype]
        self.max_ctx, self.name, self.quant = max_ctx, name, quant
        self.spec, self.draft_weights = speculation, draft_weights
        self.kv_options = kv_options or KVOptions()
        if speculation is not None:
            check_draft(cfg, speculation, draft_weights)
            self.kv_options = dataclasses.replace(
                self.kv_options, spec_tokens=max(self.kv_options.spec_tokens, speculation.k)
            )
        self.kv_layout = choose_layout(kv_quant, max_ctx, self.kv_options)
        if max_ctx > cfg.max_position:
            warnings.warn(
                f"max_ctx {max_ctx} is beyond the model's trained context of {cfg.max_position} "
                f"tokens; output quality past it is not guaranteed",
                stacklevel=2,
            )
        check_fits(self.kv_plan(1))
        self.stats = GenerateStats()
        d = self.dtype
        o = self.ops
        self._fns = {
            "prefill": jax.jit(
                partial(core.prefill, cfg, ops=o, spec=speculation, dtype=d),
                static_argnames=("out", "logprobs"),
                donate_argnames=("state",),
            ),
            "decode": jax.jit(
                partial(core.decode, cfg, ops=o, spec=speculation, dtype=d),
                static_argnames=("max_steps", "rows", "logprobs", "fixed"),
                donate_argnames=("state",),
            ),
            "fork": jax.jit(
                partial(core.fork, cfg, ops=o, spec=speculation, dtype=d),
                static_argnames=("logprobs",),
                donate_argnames=("state",),
            ),
            "seed_history": jax.jit(
                partial(core.seed_history, cfg, ops=o, spec=speculation, dtype=d), donate_argnames=("state",)
            ),
            "decode_forward": jax.jit(
                partial(core.decode_forward, cfg, ops=o, spec=speculation, dtype=d),
                static_argnames=("rows",),
                donate_argnames=("state",),
            ),
            "decode_sample": jax.jit(
                partial(core.decode_sample, cfg, ops=o, spec=speculation, dtype=d),
                static_argnames=("rows", "logprobs", "greedy"),
                donate_argnames=("state",),
            ),
        }
        self._executables: dict = {}
        self.compile_s = 0.0  # seconds spent compiling the core's calls so far
        self.compiles = Compiles()  # the programs made so far, by where each came from
        self.on_compile = None  # on_compile(n_calls) -> a callable to call when they are done
        self.caches = caches or Caches()
        self.steps_cache = executables_folder(enable(self.caches.compilation))  # where calls are kept, or None

    # -- the core's compiled calls ----------------------------------------------------------------
    @property
    def call_weights(self):
        """What the core's calls take as weights: the model's, and the draft model's with one."""
        return self.weights if self.draft_weights is None else (self.weights, self.draft_weights)

    def run(self, name: str, *args, **static):
        """Call the core's `name` ("prefill", "decode", "fork", "decode_forward" or "decode_sample") with
        the weights and `args`, through the executable compiled for these shapes (compiled now if this
        is their first call)."""
        return self.executable(name, args, static)(self.call_weights, *args)

    def executable(self, name: str, args, static: dict):
        key = _signature(name, args, static)
        exe = self._executables.get(key)
        if exe is None:
            exe = self._executables[key] = self._compile(name, args, static)
        return exe

    def _compile(self, name: str, args, static: dict):
        """The call read from the compiled-steps cache, or lowered, compiled and kept there."""
        t0 = time.perf_counter()
        key = self._disk_key(name, args, static)
        exe = self._on_mesh(compilation_cache.load_executable(self.steps_cache, key), key)
        if exe is None:
            exe = self._compile_lowered(key, self._lower(name, args, static))
        else:
            self.compiles.add("read")
        self.compile_s += time.perf_counter() - t0
        return exe

    def _on_mesh(self, exe, key: str):
        """A stored executable, unless it was compiled for other devices than this engine's mesh
        (then None: it is compiled again). Its key names the mesh, so this only guards against a
        stored file that is not what its name says."""
        if exe is None:
            return None
        mesh = set(self.layout.mesh.devices.flat)
        if all(s.device_set == mesh for s in jax.tree_util.tree_leaves(exe.input_shardings)):
            return exe
        log.warning("compiled step %s is for other devices than this engine's; compiling it again", key)
        return None

    def _compile_lowered(self, key: str | None, lowered):
        exe, answered = compilation_cache.compile_and_keep(self.steps_cache, key, lowered, self.ops.compiler_options())
        self.compiles.add("compiled")
        if answered:
            self.compiles.add("from_jax_cache")
        return exe

    def _lower(self, name: str, args, static: dict):
        return self._fns[name].lower(self.call_weights, *args, **static)

    def _disk_key(self, name: str, args, static: dict) -> str | None:
        if self.steps_cache is None:
            return None
        mesh = self.layout.mesh
        devices = [(d.platform, d.device_kind, d.id) for d in mesh.devices.flat]
        return compilation_cache.executable_key(
            name,
            sorted(static.items()),
            self.cfg,
            self.runtime,
            self.dtype_name,
            self.quant,
            self.kv_layout,
            self.kv_options,
            self.spec,
            self.caches.compile_env,
            devices,
            mesh.shape,
            jax.process_count(),
            backends.memory_limit(mesh.devices.flat[0]),  # the weights widened once where it leaves room
            compilation_cache.describe(self.call_weights),
            compilation_cache.describe(args),
        )

    def read_back(self, calls: list[tuple[str, tuple, dict]]) -> int:
        """Read back, on threads, the calls the compiled-steps cache holds (loading an executable
        onto the devices runs without the GIL). -> how many were read."""
        todo = {k: c for c in calls for k in [_signature(*c)] if k not in self._executables}
        keys = list(todo)

        def load(k):
            key = self._disk_key(*todo[k])
            return self._on_mesh(compilation_cache.load_executable(self.steps_cache, key), key)

        found = map_threads(load, keys)
        loaded = {k: exe for k, exe in zip(keys, found) if exe is not None}
        self._executables.update(loaded)
        self.compiles.add("read", len(loaded))
        return len(loaded)

    def compiled(self, call: tuple[str, tuple, dict]) -> bool:
        return _signature(*call) in self._executables

    def precompile(
        self, calls: list[tuple[str, tuple, dict]], threads: int | None = None, counted: bool = True, on_compiled=None
    ) -> float:
        """Compile every (name, args, static) call not compiled yet, together (`compile_all`), after
        reading back what the compiled-steps cache holds. args may be shape structs. `counted`:
        add the time to `compile_s`, which a caller timing its own calls reads (not for compiles
        on a thread beside them). `on_compiled()`: called as each call's executable is in place,
        before the others are done. -> seconds taken."""
        t0 = time.perf_counter()
        loaded = self.read_back(calls) if self.steps_cache is not None else 0
        todo = {k: c for c in calls for k in [_signature(*c)] if k not in self._executables}
        if not todo and not loaded:
            return 0.0
        done = self.on_compile(len(todo)) if self.on_compile and todo else None
        traced = 0.0

        def lower(key):
            nonlocal traced
            t = time.perf_counter()
            lowered = self._lower(*todo[key])
            traced += time.perf_counter() - t
            return lowered

        def compile_and_keep(key, lowered):
            t = time.perf_counter()
            exe = self._compile_lowered(self._disk_key(*todo[key]), lowered)
            name, args, static = todo[key]
            shape = [tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(args[1:])[:1]]  # a prefill's [P, C]
            log.debug("compiled %s %s %s in %.1f s", name, static, shape, time.perf_counter() - t)
            self._executables[key] = exe
            if on_compiled is not None:
                on_compiled()
            return exe

        compile_all(todo, lower, compile_and_keep, threads)
        dt = time.perf_counter() - t0
        log.info(
            "%d calls compiled in %.1f s (%.1f s of it tracing and lowering), %d read from the compiled-steps cache",
            len(todo),
            dt,
            traced,
            loaded,
        )
        if done is not None:
            done()
        if counted:
            self.compile_s += dt
        return dt

    # -- the core's state on the mesh -----------------------------------------------------------
    def core(
        self,
        num_slots: int,
        max_len: int,
        budget: int | None = None,
        span: int | None = None,
        prefix_caching: bool = False,
        steady: int | None = None,
    ) -> EngineCore:
        """`num_slots` rows of up to `max_len` positions and their slot table, on the mesh: each row
        with blocks of its own for its whole run (a lockstep batch), or (`budget`: bytes) a pool
        of that size from which the host hands rows blocks as they need them (`engine.blocks`;
        `span`: positions a call may write past a row's lowest position: by default as many as
        a prefill forward takes)."""
        return EngineCore(self, num_slots, max_len, budget, span, prefix_caching, steady)

    def kv_specs(self) -> list:
        """The KV pools of the model and of the draft model, as `PoolPlan` takes them."""
        models = [kind_specs(self.cfg, self.kv_layout, self.kv_options)]
        if self.spec is not None and self.spec.draft_cfg is not None:
            models.append(kind_specs(self.spec.draft_cfg, self.kv_layout, self.kv_options))
        return models

    def pool_plan(
        self, rows: int, max_len: int, budget: int | None = None, span: int | None = None, steady: int | None = None
    ) -> PoolPlan:
        """The pools for `rows` sequences of up to `max_len` positions: every row its own blocks, or
        as many as `budget` bytes hold; with their bytes on each device of the mesh. `span`: the
        positions a call may write past a row's lowest position (a prefill piece's length; a
        speculative cycle's tokens at least); `steady`: those a decode call may write past them."""
        o = self.kv_options
        span = max(span or 1, o.spec_tokens + 1)
        itemsize = np.dtype(self.dtype).itemsize
        if budget is None:
            plan = PoolPlan.for_rows(self.kv_specs(), self.kv_layout, o.block_size, itemsize, rows, max_len, span)
        else:
            plan = PoolPlan.for_budget(
                self.kv_specs(), self.kv_layout, o.block_size, itemsize, rows, max_len, span, budget, steady
            )
        if self.layout.mesh.size == 1:
            return plan
        return dataclasses.replace(plan, per_device=per_device_bytes(self.state_shapes(plan).cache.pools))

    def kv_budget(
        self, rows: int, max_len: int, span: int, memory, batched_tokens: int, steady: int | None = None
    ) -> int:
        """Bytes of a scheduler's KV pool (`memory.KVMemory`): its size where given; where the
        device says what its allocator may use, `utilization` of that less what is in use and room
        for the calls' own buffers (a prefill of `batched_tokens` tokens' activations, the decode
        rows' logits), counted on the device that holds the most of the pool; elsewhere (a CPU) room
        for every slot at its longest."""
        if memory.size is not None:
            return int(memory.size)
        stats = device_stats(self.layout.mesh.devices.flat[0]) or {}
        one = self.pool_plan(rows, max_len, span=span, steady=steady)
        if "bytes_limit" not in stats or memory.every_slot:
            return one.total
        cfg = self.cfg
        width = cfg.hidden_size * 8 + cfg.intermediate_size * 3
        reserve = max(1 << 30, batched_tokens * width * 4 + 4 * rows * cfg.vocab_size * 4)
        free = memory.utilization * stats["bytes_limit"] - stats.get("bytes_in_use", 0) - reserve
        return max(0, int(free * one.total / one.device_bytes))

    def _make_state(self, plan: PoolPlan, tables: dict) -> State:
        """The one place KV pools are made: the engine's KV layout (the draft model's pools too,
        where there is one), and an empty slot table."""
        o, kv_dtype = self.kv_options, self.ops.kv_dtype(self.dtype)
        models = self.kv_specs()
        pools = [make_pools(specs, plan.blocks, plan.block_size, kv_dtype, o.read) for specs in models]
        slots = Slots.empty(
            plan.rows,
            plan.max_len,
            self.spec is not None,
            self.cfg.vocab_size,
            hidden=(self.cfg.hidden_size, self.dtype),
        )
        return State(PagedCache(pools[0], tables), slots, pools[1] if len(pools) > 1 else None)

    def new_state(self, plan: PoolPlan, tables: dict | None = None) -> State:
        """Zeroed pools laid out on the mesh (KV heads over "model"), the rows' block tables (each row
        its own blocks where not given) and an empty slot table."""
        tables = static_tables(plan.widths, plan.rows) if tables is None else tables
        tables = {n: self.put_rows(t) for n, t in tables.items()}
        key = (plan.rows, plan.max_len, tuple(sorted(plan.blocks.items())), tuple(sorted(plan.widths.items())))
        if key not in self._state_makers:  # one compiled allocator per pool shape

            def make(tables):
                return self._make_state(plan, tables)

            shapes = jax.eval_shape(make, tables)
            self._state_makers[key] = jax.jit(make, out_shardings=self.state_shardings(shapes), donate_argnums=0)
            self.compiles.add("allocators")
        return self._state_makers[key](tables)

    def state_shapes(self, plan: PoolPlan) -> State:
        """The state `new_state` makes, as shape structs with their shardings (nothing allocated)."""
        tables = {n: jax.ShapeDtypeStruct((plan.rows, w), np.int32) for n, w in plan.widths.items()}
        shapes = jax.eval_shape(partial(self._make_state, plan), tables)
        return jax.tree_util.tree_map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, self.state_shardings(shapes)
        )

    def state_shardings(self, state: State) -> State:
        rows = jax.tree_util.tree_map(lambda a: self.layout.batch_sharding(a.shape), state.slots)
        tables = {n: self.layout.batch_sharding(t.shape) for n, t in state.cache.tables.items()}
        draft = None if state.draft_cache is None else self.layout.cache_shardings(state.draft_cache)
        return State(PagedCache(self.layout.cache_shardings(state.cache.pools), tables), rows, draft)

    def put_rows(self, tree):
        """Per-row host data (a pytree of arrays with the row axis first) -> global arrays split over
        the data axis like the cache rows."""

        def put(x):
            x = np.asarray(x)
            return self.layout.put(x, self.layout.batch_sharding(x.shape))

        return jax.tree_util.tree_map(put, tree)

    def row_shapes(self, tree):
        """Shape structs of per-row data (as `put_rows` would lay it out), to compile for ahead."""

        def shape(a):
            return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=self.layout.batch_sharding(np.shape(a)))

        return jax.tree_util.tree_map(shape, tree)

    def core_out_size(self, n_tokens: int, lo: int = 1) -> int:
        """A decode call's output buffer for n_tokens tokens a row, a power of two of at least
        `lo` (see `EngineCore.out_size`)."""
        return bucket(n_tokens + (0 if self.spec is None else self.spec.k + 1), lo)

    def padded_len(self, positions: int) -> int:
        """The positions sequences of up to `positions` are given KV blocks and compiled for: a
        power of two of whole blocks (64, 128, 256, ... positions by default), at most max_ctx. A
        prompt length or max_tokens that lands in the same one compiles nothing new."""
        return min(bucket(positions, self.kv_options.block_size), self.max_ctx)

    def kv_plan(self, batch: int, length: int | None = None) -> PoolPlan:
        """What the pools of `batch` rows of `length` (default max_ctx) positions each take."""
        return self.pool_plan(batch, length or self.max_ctx)

    def chunking(self, longest: int) -> tuple[int, int]:
        """(chunk size, padded length) of a lockstep prefill: short prompts use their power-of-two
        bucket as the chunk, so they compile one small shape; the padded length is whole chunks.
        """
        C = min(self.kv_options.prefill_chunk, bucket(longest))
        return C, -(-longest // C) * C

    # -- full forward ----------------------------------------------------------------------------
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
        C, Tp = self.chunking(T)
        lens = np.full((B,), T, np.int32) if lengths is None else np.asarray(lengths, np.int32)
        eng_core = self.core(B, min(Tp, max(self.max_ctx, T)), span=C)
        return eng_core.logits(pad_rows(list(ids), Tp, self.cfg.pad_id), lens, C)[:, :T]

    # -- generation ------------------------------------------------------------------------------
    def encode_prompt(self, prompt, chat: bool | None = None) -> list[int]:
        """A prompt's ids: a list of chat messages through the chat template; a string through it
        where `chat` is true, as written where false, and by default (None) as the model is: the
        template where the model is chat-tuned (`Tokenizer.chat_tuned`), raw on a base model."""
        if self.tokenizer is None:
            raise RequestError("this model directory has no tokenizer.json; pass token ids instead")
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            return self.tokenizer.encode_chat(list(prompt))
        if not isinstance(prompt, str):
            raise RequestError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        if self.tokenizer.chat_tuned if chat is None else chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(
        self,
        prompts,
        max_tokens=64,
        temperature=0.0,
        top_k=None,
        top_p=None,
        seed=0,
        stop=None,
        chat: bool | None = None,
        logprobs: int | None = None,
        **penalties,
    ) -> list[Completion]:
        """Strings (or lists of chat messages) -> a Completion each; `chat` as in `encode_prompt`,
        the rest as in `generate_ids`."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise RequestError("no prompts given")
        ids = [self.encode_prompt(p, chat) for p in prompts]
        return self.generate_ids(ids, max_tokens, temperature, top_k, top_p, seed, stop, logprobs, **penalties)

    def generate_ids(
        self,
        ids: list[list[int]],
        max_tokens=64,
        temperature=0.0,
        top_k=None,
        top_p=None,
        seed=0,
        stop=None,
        logprobs: int | None = None,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias=None,
        stop_token_ids=None,
        min_tokens=0,
        min_p=0.0,
    ) -> list[Completion]:
        """Prompts of one length: the lockstep batch, every row with blocks of its own, prefilled in
        chunks, then decoded to completion in one on-device loop; what it needs compiled is
        compiled first, so `stats` times the run itself. Prompts of mixed lengths: the scheduler's
        continuous batching (`engine.batch`), each prompt prefilled as itself, a prefix they share
        prefilled once. `logprobs` n (0 to 20): each token's log-probability and the n most likely
        tokens, computed on the device. `min_p`: vLLM's min-p (`sampling.filtered`). The penalties
        are vLLM's and OpenAI's (`sampling.penalize`);
        `logit_bias` ({token id: bias}), `stop_token_ids` and `min_tokens` as the server's
        (`sampling.apply_rules`). Row b samples with seed + b (`request.nth_seed`, as choice b of a
        server request): the rows draw apart, one seed reproduces the call, and a row's tokens are
        those of its prompt alone with seed + b, whichever path runs it."""
        asked = Request(
            [],
            max_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            stop=stop,
            logprobs=logprobs,
            logit_bias=logit_bias,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
            min_p=min_p,
        ).check(self.cfg.vocab_size)  # the checks every request meets, the server's too
        seed, stop, stops = asked.seed, asked.stop, asked.stop_token_ids
        n_lp = check_logprobs(logprobs)
        lens = [len(x) for x in ids]
        if min(lens) == 0:
            raise RequestError("a prompt encoded to no tokens")
        n = max(lens)
        if n + max_tokens > self.max_ctx:
            raise RequestError(
                f"a prompt of {n} tokens and max_tokens {max_tokens} need {n + max_tokens} "
                f"positions, more than max_ctx {self.max_ctx}: lower max_tokens to at most "
                f"{max(self.max_ctx - n, 0)} or raise max_ctx"
            )

        if len(set(lens)) > 1:
            reqs = [dataclasses.replace(asked, prompt_ids=list(x), seed=nth_seed(seed, b)) for b, x in enumerate(ids)]
            outs, (ttft, decode_s, compile_s, spec) = batch.generate(self, ids, reqs)
            new = sum(len(t) for t, _ in outs)
            self.stats = GenerateStats(
                len(ids), sum(lens), new, ttft, decode_s, max(len(t) for t, _ in outs), compile_s, spec
            )
        else:
            outs = batch.lockstep(self, ids, asked, n_lp)
        return [
            self._finish(x, toks, stop, lp if logprobs is not None else None, stops) for x, (toks, lp) in zip(ids, outs)
        ]

    def _finish(self, prompt_ids, new_ids, stop, logprobs=None, stops=()) -> Completion:
        """The answer's text, cut at its first stop string as the server's streams cut it (one
        `TextStream` for both), and the tokens that text covers."""
        reason = "length"
        if new_ids and (new_ids[-1] in self.cfg.eos_ids or new_ids[-1] in stops):
            new_ids, reason = new_ids[:-1], "stop"
        text = ""
        if self.tokenizer is not None:
            stream = TextStream(self.tokenizer, stop)
            text = stream.push_many(new_ids)[0] + stream.finish()
            if stream.stopped:
                new_ids, reason = new_ids[: stream.settled()], "stop"
        return Completion(
            text, new_ids, reason, list(prompt_ids), None if logprobs is None else logprobs[: len(new_ids)]
        )

    def perplexity(self, text: str, window: int = 2048, stride: int | None = None):
        """Sliding-window perplexity of `text` -> PerplexityResult (.ppl .nll .num_scored_tokens)."""
        return perplexity(self, text, window, stride)


def check_draft(cfg: ModelConfig, spec: Speculation, draft_weights) -> None:
    if spec.method == "draft":
        if draft_weights is None:
            raise ModelError("speculation with a draft model needs the draft model's weights")
        # Gemma 3 270M and 1B have 262144 ids, the larger Gemma 3 262208 (the same tokenizer, with
        # image tokens appended): every id a draft proposes is one of the model's.
        if spec.draft_cfg.vocab_size > cfg.vocab_size:
            raise ModelError(
                f"the draft model's vocabulary ({spec.draft_cfg.vocab_size} tokens) is larger than "
                f"the model's ({cfg.vocab_size}): a draft model must share the tokenizer"
            )


def _signature(name: str, args, static: dict):
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (
        name,
        tuple(sorted(static.items())),
        tree,
        tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves),
    )
