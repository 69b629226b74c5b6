"""The pieces every family's layer is built from: the attention block over a KV cache, the
feed-forward block (a gated MLP or routed experts), and the pre-norm decoder layer. Every hot
operation goes through the backend (`ops`), which may keep its own forms of weights and activations
between its operations; the model only passes them on."""

from __future__ import annotations

import jax

from jaxllm.config.model import ModelConfig
from jaxllm.model.moe import MOE_WEIGHTS, routed_mlp
from jaxllm.model.schedule import Branch
from jaxllm.ops.xla import HeadPrep, KeysFromValues, inv_frequencies


def head_prep(cfg: ModelConfig, w: dict, inv_freq) -> HeadPrep:
    norm = (lambda n: w.get(n)) if cfg.qk_norm else (lambda n: None)  # no K norm: a layer reading another's KV
    return HeadPrep(inv_freq, norm("q_norm"), norm("k_norm"), cfg.v_norm, cfg.norm_eps, cfg.norm_offset)


def attention_block(
    cfg: ModelConfig,
    kind: int,
    w: dict,
    h,
    positions: jax.Array,
    layer_cache,
    ops,
    own_kv: bool = True,
    partials: bool = False,
):
    """Project, write this step's K/V into the layer's KV blocks (`kv.paged.LayerKV`), attend over
    the row's blocks, project out (with `partials`, possibly in the backend's own form, for
    `add_norm`). With `own_kv=False` the layer only projects Q and attends over what an earlier
    layer wrote."""
    a = cfg.attn[kind]
    inv_freq = inv_frequencies(a.rope, a.head_dim)
    if own_kv:
        names = ["q", "k"] + ([] if a.k_eq_v else ["v"])
        q, k, *v = ops.linears(h, [w[n] for n in names], partials=True)
        v = k if a.k_eq_v else v[0]  # no V projection: V is the raw K
    else:
        q, k, v = ops.linear(h, w["q"], partials=True), None, None
    q, k, v, layer_cache = ops.head_prologue(q, k, v, head_prep(cfg, w, inv_freq), positions, layer_cache)
    if k is not None:  # not written by the backend's prologue
        layer_cache = layer_cache.write(k, v, positions)
    keys = None
    if layer_cache.keys_from_values:  # a pool of values alone: keys rebuilt from them
        k_norm = ops.weight(w["k_norm"]) if cfg.qk_norm and "k_norm" in w else None
        keys = KeysFromValues(inv_freq, k_norm, cfg.norm_eps, cfg.norm_offset)
    o = layer_cache.attend(
        q, positions, ops, scale=cfg.query_scale, softcap=cfg.attn_softcap, window=a.window, keys=keys
    )
    return ops.linear(o, w["o"], 2, partials), layer_cache


def feed_forward(cfg: ModelConfig, b: Branch, w: dict, h, ops):
    """The layer's gated MLP, or the experts its router picks for each token (`model.moe`)."""
    if b.routed:
        moe_w = {n: ops.weight(w[n]) for n in MOE_WEIGHTS if n in w}
        return routed_mlp(cfg.moe, moe_w, ops.value(h), cfg.activation, cfg.norm_eps)
    return ops.gated_mlp(h, w["gate"], w["up"], w["down"], cfg.activation, partials=True)


def decoder_layer(cfg: ModelConfig, b: Branch, w: dict, x, h, positions, layer_cache, ops):
    """One pre-norm layer on the residual stream (x, h) (see `XlaOps.next_input`) -> the stream
    entering the next layer (whose input norm is `w["next_norm"]`), the layer's cache."""
    h = ops.layer_input(x, h, w["attn_norm"], cfg.norm_eps, cfg.norm_offset)
    a, layer_cache = attention_block(cfg, b.kind, w, h, positions, layer_cache, ops, partials=True)
    eps, off = cfg.norm_eps, cfg.norm_offset
    x, m_in = ops.add_norm(x, a, w["post_attn_norm"] if cfg.sandwich_norms else None, w["mlp_norm"], eps, off)
    m = feed_forward(cfg, b, w, m_in, ops)
    post = w["post_mlp_norm"] if cfg.sandwich_norms else None
    return ops.close_layer(x, m, post, w["next_norm"], eps, off, h_into=h), layer_cache
