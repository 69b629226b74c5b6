"""The forward pass: embed, one `lax.scan` over all layers, final norm and logits.

Each scan step gets its layer's schedule entry: `lax.switch` picks the branch (sliding or global, plus
any family-specific groups such as Gemma 4's KV-sharing layers), and the branch reads its weights at
`idx` in its group's stack and its KV cache at `cache_idx` in its kind's stack. With a single branch
(Qwen3) there is no switch at all.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kv import linear as kv
from jaxllm.kv import split
from jaxllm.config.model import GLOBAL, KIND_NAMES, SLIDING, ModelConfig
from jaxllm.errors import ModelError
from jaxllm.model.layers import (add_norm, attend, attention_mask, finish_q, finish_qkv, gated_mlp, inv_frequencies, raw_qkv, rms_norm)
from jaxllm.ops import gpu as kernels
from jaxllm.ops.gpu.dispatch import MAX_ROWS, NORM_ROWS, cached_attention, embed_rows, output_head, prologue
from jaxllm.ops.gpu.prologue import HeadPrep
from jaxllm.quant import Normed, OutMajor, Stacked, linear, matmul_rows, take_rows, total


@dataclass(frozen=True)
class Branch:
    """One path through a layer: its weight stack (group), attention kind, and whether it keeps a KV
    cache of its own or attends over another layer's."""
    group: str
    kind: int
    own_kv: bool = True


def _branch_of(cfg: ModelConfig, layer: int) -> Branch:
    return Branch(cfg.group_of(layer), cfg.layer_kinds[layer], cfg.kv_source(layer) == layer)


def branches(cfg: ModelConfig) -> tuple[Branch, ...]:
    out: list[Branch] = []
    for i in range(cfg.num_layers):
        b = _branch_of(cfg, i)
        if b not in out:
            if any(o.group == b.group for o in out):
                raise ModelError(f"layer group {b.group!r} mixes attention kinds or KV sharing")
            out.append(b)
    return tuple(out)


def schedule(cfg: ModelConfig) -> dict:
    """Per-layer scan inputs: the branch, the index in its group's weight stack, and the index of the
    KV cache it attends over in its kind's cache stack."""
    brs = branches(cfg)
    slot: dict[int, int] = {}
    n_cache = {SLIDING: 0, GLOBAL: 0}
    n_group: dict[str, int] = {}
    out = {"kind": [], "branch": [], "idx": [], "cache_idx": []}
    for i, k in enumerate(cfg.layer_kinds):
        b = _branch_of(cfg, i)
        if b.own_kv:
            slot[i] = n_cache[k]
            n_cache[k] += 1
        src = cfg.kv_source(i)
        if src not in slot or cfg.layer_kinds[src] != k:
            raise ModelError(f"layer {i} reads the KV cache of layer {src}, which is not an earlier "
                             f"layer of the same attention kind")
        out["kind"].append(k)
        out["branch"].append(brs.index(b))
        out["idx"].append(n_group.get(b.group, 0))
        n_group[b.group] = out["idx"][-1] + 1
        out["cache_idx"].append(slot[src])
    return {k: np.asarray(v, np.int32) for k, v in out.items()}


def family_hooks(cfg: ModelConfig):
    """The family module, for its optional `decoder_layer` and `layer_inputs` overrides."""
    from jaxllm.model.families import family_named
    return family_named(cfg.family)


def embed(cfg: ModelConfig, weights: dict, tokens: jax.Array, dtype) -> jax.Array:
    x = embed_rows(weights["embed"], tokens, dtype)          # vocabulary-sharded: no table gather
    if x is None:
        x = take_rows(weights["embed"], tokens, dtype)
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, dtype)
    return x


def logits_from_hidden(cfg: ModelConfig, weights: dict, h: jax.Array) -> jax.Array:
    h = rms_norm(h, weights["final_norm"], cfg.norm_eps, cfg.norm_offset)
    head = weights["embed"] if cfg.tie_embeddings else weights["lm_head"]
    out = output_head(h, head, cfg.tie_embeddings)
    if out is None and cfg.tie_embeddings:
        out = matmul_rows(h, head)
    elif out is None:
        out = linear(h, head).astype(jnp.float32)
    if cfg.final_softcap is not None:
        out = jnp.tanh(out / cfg.final_softcap) * cfg.final_softcap
    return out


def head_prep(cfg: ModelConfig, w: dict, inv_freq) -> HeadPrep:
    norm = (lambda n: w.get(n)) if cfg.qk_norm else (lambda n: None)   # no K norm: a layer reading another's KV
    return HeadPrep(inv_freq, norm("q_norm"), norm("k_norm"), cfg.v_norm, cfg.norm_eps, cfg.norm_offset)


def attention_block(cfg, kind, w, h, positions, layer_cache, own_kv: bool = True, partials: bool = False):
    """Project, write this step's K/V into the layer's cache, attend over the cache, project out
    (with `partials`, possibly as the O matmul's unsummed `Partials`, for `add_norm`).
    With `own_kv=False` the layer only projects Q and attends over a cache an earlier layer wrote.
    One decode token per row with the kernels on: the norms, RoPE and the cache write are one
    kernel (`kernels.prologue`)."""
    a = cfg.attn[kind]
    inv_freq = inv_frequencies(a.rope, a.head_dim)
    if own_kv:                           # K-split projections may be left for the prologue to sum
        q, k, v = raw_qkv(cfg, a, w, h, partials=True)
    else:
        q, k, v = linear(h, w["q"], partials=True), None, None
    fused = prologue(q, k, v, head_prep(cfg, w, inv_freq), positions, layer_cache)
    if fused is not None:
        q, layer_cache = fused
    elif own_kv:
        q, k, v = finish_qkv(cfg, w, total(q), total(k), total(v), positions, inv_freq)
    else:
        q = finish_q(cfg, w, total(q), positions, inv_freq)
    written = fused is not None or not own_kv
    if not isinstance(layer_cache, kv.LayerKV):    # split cache (ring buffer / blockwise global)
        if written:
            o = layer_cache.attend(cfg, a, w, q, positions)
        else:
            o, layer_cache = layer_cache.update_and_attend(cfg, a, w, q, k, v, positions)
        return linear(o, w["o"], 2, partials), layer_cache
    if not written:
        layer_cache = layer_cache.write(k, v, positions)
    o = cached_attention(q, layer_cache, positions, scale=cfg.query_scale, softcap=cfg.attn_softcap,
                         window=a.window)
    if o is None:
        lc = layer_cache.layer()
        B, S = lc["k"].shape[0], lc["k"].shape[1]
        mask = attention_mask(positions, kv.slot_positions(B, S), a.window)
        o = attend(q, lc["k"], lc["v"], mask, cfg.query_scale, cfg.attn_softcap)
    return linear(o, w["o"], 2, partials), layer_cache


def decoder_layer(cfg, kind, w, x, positions, layer_cache, h=None, next_norm=None):
    """One layer on the residual stream x. With `next_norm` (the next layer's input norm weight),
    `h` is x already normed for this layer, and the layer returns (x', next_norm applied to x'), the
    residual add after the MLP and that norm one kernel (`add_norm`)."""
    post_mlp = w["post_mlp_norm"] if cfg.sandwich_norms else None
    h_in = h
    if h is None:
        h = Normed(x, w["attn_norm"], cfg.norm_eps, cfg.norm_offset)      # normed in the Q/K/V kernel
    a, layer_cache = attention_block(cfg, kind, w, h, positions, layer_cache, partials=True)
    x, h = add_norm(x, a, w["post_attn_norm"] if cfg.sandwich_norms else None, w["mlp_norm"],
                    cfg.norm_eps, cfg.norm_offset)
    if next_norm is not None:
        m = gated_mlp(cfg, w, h, partials=True)
        return add_norm(x, m, post_mlp, next_norm, cfg.norm_eps, cfg.norm_offset, h_into=h_in), layer_cache
    m = gated_mlp(cfg, w, h)
    if post_mlp is not None:
        m = rms_norm(m, post_mlp, cfg.norm_eps, cfg.norm_offset)
    return x + m, layer_cache


def take(tree, i):
    return jax.tree_util.tree_map(lambda a: a[i], tree)


# Weights only ever contracted by `linear`, and the norms the decode kernels read (the input norm
# in the Q/K/V matmul, the per-head ones in the prologue, those around the residual add in
# `add_norm`): with the kernels on, these stay in their layer stack.
MATMUL_WEIGHTS = ("q", "k", "v", "o", "gate", "up", "down", "ple_gate", "ple_out")
IN_PLACE = MATMUL_WEIGHTS + ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


def layer_weights(group: dict, idx):
    """A layer's weights: sliced out of the group's stacks, except, when the Pallas kernels are on,
    the matmul weights, which are handed over as `Stacked` views for the kernels to read in place
    (as are output-major ones always: `linear` contracts them the right way round)."""
    on = kernels.enabled()

    def one(k, v):
        if isinstance(v, OutMajor):
            return Stacked(v.w, idx, k, out_major=True)
        return Stacked(v, idx, k) if on and k in IN_PLACE else take(v, idx)
    return {k: one(k, v) for k, v in group.items()}


def put(tree, i, new, rows=None):
    """Layer i of a cache stack tree set to `new`: cache rows `rows` of it where given, else its
    leading rows (as many as `new` has)."""
    if rows is None:
        return jax.tree_util.tree_map(lambda a, n: a.at[i, :n.shape[0]].set(n), tree, new)
    return jax.tree_util.tree_map(lambda a, n: a.at[i, rows].set(n, mode="drop"), tree, new)


def forward(cfg: ModelConfig, weights: dict, tokens: jax.Array, positions: jax.Array,
            cache: dict, dtype=jnp.bfloat16, rows: jax.Array | None = None):
    """tokens/positions [B, T] -> hidden states [B, T, D] and the updated cache.

    Each token is written into the cache at its position (a negative position is padding, never
    written) and attends to everything its row of the cache holds at earlier positions. `rows` [B]
    names the cache row of each batch row (a prefill into some of a cache's rows; a row past the
    cache's end is padding); None: batch row b is cache row b (the cache may hold more rows).
    """
    hooks = family_hooks(cfg)
    x = embed(cfg, weights, tokens, dtype)
    xs = jax.tree_util.tree_map(jnp.asarray, schedule(cfg))
    if getattr(hooks, "layer_inputs", None) is not None:
        xs["inputs"] = hooks.layer_inputs(cfg, weights, tokens, x)     # leading axis: layers
    layer_fn = getattr(hooks, "decoder_layer", None)
    brs = branches(cfg)
    unroll = scan_unroll(cfg, *tokens.shape)
    next_norms = None
    if layer_fn is None and tokens.size > NORM_ROWS:
        # Several rows: each layer ends with its residual add and the next layer's input norm in
        # one kernel, and the stream carries x normed for the layer ahead.
        next_norms = next_input_norms(cfg, weights)
        first = weights["layers"][cfg.group_of(0)]["attn_norm"][0]
        x = (x, rms_norm(x, first, cfg.norm_eps, cfg.norm_offset))

    def branch(b: Branch):
        name = KIND_NAMES[b.kind]

        def run(x, caches, s):
            w = layer_weights(weights["layers"][b.group], s["idx"])
            lc = caches[name]
            if isinstance(lc, dict):
                lc = kv.LayerKV(lc, s["cache_idx"], rows, tokens.shape[0])
            else:
                lc = split.layer_view(lc, s["cache_idx"], tokens.shape[1], rows, tokens.shape[0])
            if next_norms is not None:
                x, lc = decoder_layer(cfg, b.kind, w, x[0], positions, lc, h=x[1],
                                      next_norm=Stacked(next_norms[b.group], s["idx"], "attn_norm"))
            elif layer_fn is None:
                x, lc = decoder_layer(cfg, b.kind, w, x, positions, lc)
            else:
                x, lc = layer_fn(cfg, b, w, x, positions, lc, s.get("inputs"))
            if not b.own_kv:
                return x, caches
            in_place = isinstance(lc, (kv.LayerKV, split.StackedLayer))
            new = lc.stack if in_place else put(caches[name], s["cache_idx"], lc, rows)
            return x, {**caches, name: new}
        return run

    def step(carry, s):
        x, caches = carry
        if len(brs) == 1:
            x, caches = branch(brs[0])(x, caches, s)
        elif len(brs) == 2:            # sliding or global
            x, caches = jax.lax.cond(s["branch"] == 0, branch(brs[0]), branch(brs[1]), x, caches, s)
        else:
            x, caches = jax.lax.switch(s["branch"], [branch(b) for b in brs], x, caches, s)
        return (x, caches), None

    p = layer_period(cfg) if len(brs) > 1 and layer_scan_mode() == "period" else None
    if p is None and counted_layers(cfg) and "inputs" not in xs:
        # Layer i reads stack entry i and cache i: the scan carries i itself instead of slicing the
        # schedule, whose index clamp was a kernel of its own each layer on GPUs.
        def counted(carry, _):
            c, i = carry
            c, _ = step(c, {"idx": i, "cache_idx": i})
            return (c, i + 1), None
        ((x, cache), _), _ = jax.lax.scan(counted, ((x, cache), jnp.int32(0)), None, length=cfg.num_layers,
                                          unroll=unroll)
        return (x, cache) if next_norms is None else (x[0], cache)
    if p is None:
        (x, cache), _ = jax.lax.scan(step, (x, cache), xs, unroll=unroll)
        return (x, cache) if next_norms is None else (x[0], cache)
    # One scan step per period of the branch pattern (Gemma's 5 sliding + 1 global), each layer of
    # it on its own static branch; the layers past the last whole period follow, unrolled.
    pattern = schedule(cfg)["branch"][:p]
    n = cfg.num_layers // p

    def period_step(carry, s):
        for j in range(p):
            carry = branch(brs[pattern[j]])(*carry, jax.tree_util.tree_map(lambda a: a[j], s))
        return carry, None
    periods = jax.tree_util.tree_map(lambda a: a[:n * p].reshape((n, p) + a.shape[1:]), xs)
    carry, _ = jax.lax.scan(period_step, (x, cache), periods, unroll=max(1, unroll // p))
    for i in range(n * p, cfg.num_layers):
        carry = branch(brs[pattern[i % p]])(*carry, jax.tree_util.tree_map(lambda a: a[i], xs))
    return carry if next_norms is None else (carry[0][0], carry[1])


def next_input_norms(cfg: ModelConfig, weights: dict) -> dict:
    """Per layer group, a stack [layers in the group, D] of the input norm weight of the layer after
    each (the final norm's after the last layer), in the group's own order."""
    idx = schedule(cfg)["idx"]

    def after(i):
        if i + 1 == cfg.num_layers:
            return weights["final_norm"]
        return weights["layers"][cfg.group_of(i + 1)]["attn_norm"][int(idx[i + 1])]
    groups = {}
    for i in range(cfg.num_layers):
        groups.setdefault(cfg.group_of(i), []).append(after(i))
    return {g: jnp.stack(rows) for g, rows in groups.items()}


def counted_layers(cfg: ModelConfig) -> bool:
    """Whether every layer takes the one branch at its own index in its weight and cache stacks."""
    s = schedule(cfg)
    n = np.arange(cfg.num_layers)
    return len(branches(cfg)) == 1 and (s["idx"] == n).all() and (s["cache_idx"] == n).all()


MAX_PERIOD = 16
LAYER_SCANS = ("auto", "cond", "period")


def layer_period(cfg: ModelConfig) -> int | None:
    """The shortest period of the layers' branch pattern (every layer on the branch of its place in
    the period, a last partial period included), or None above `MAX_PERIOD` layers."""
    b = schedule(cfg)["branch"]
    return next((p for p in range(1, min(MAX_PERIOD, len(b)) + 1)
                 if all(b[i] == b[i % p] for i in range(len(b)))), None)


def layer_scan_mode() -> str:
    """How the scan reaches a layer's sliding or global branch: `cond`, a `lax.cond` per layer, or
    `period`, a scan over whole periods of the pattern with each branch fixed. On a GPU XLA decides a
    conditional on the host: a device-to-host copy and a wait each layer, so there `auto` (the
    default; JAXLLM_LAYER_SCAN sets it) takes periods. TPUs and CPUs decide it on the device."""
    m = os.environ.get("JAXLLM_LAYER_SCAN", "auto").strip().lower() or "auto"
    if m not in LAYER_SCANS:
        raise ModelError(f"JAXLLM_LAYER_SCAN must be one of {', '.join(LAYER_SCANS)}, got {m!r}")
    if m != "auto":
        return m
    return "period" if kernels.platform() == "gpu" else "cond"


def scan_unroll(cfg: ModelConfig, rows: int, tokens_per_row: int) -> int:
    """Layers per iteration of the layer scan. A decode step on the Pallas kernels runs the scan
    unrolled whole: on a GPU every loop iteration costs a kernel of its own (the counter) and the gap
    of a launch, and Qwen3-4B at batch 1 on one H100 took 2.39 ms a step unrolled against 2.45
    rolled. Everything else keeps one layer an iteration: unrolled, a 2048-token prefill there took
    91 ms against 80, and the XLA path's batch-1 step 13.0 ms against 9.2. JAXLLM_SCAN_UNROLL sets it
    for every forward: a count of layers, or `full`."""
    raw = os.environ.get("JAXLLM_SCAN_UNROLL", "").strip().lower()
    if not raw:
        decode = tokens_per_row == 1 and rows <= MAX_ROWS and kernels.enabled()
        return cfg.num_layers if decode else 1
    if raw == "full":
        return cfg.num_layers
    if not raw.isdigit() or int(raw) < 1:
        raise ModelError(f"JAXLLM_SCAN_UNROLL must be a positive number of layers or 'full', got {raw!r}")
    return min(int(raw), cfg.num_layers)
