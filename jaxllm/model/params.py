"""Abstract-first weights: one description of every tensor (shape, logical axes, how it quantizes),
from which loading, random init and sharding all follow.

The weights pytree is a plain nested dict:
    {"embed": [V, D], "final_norm": [D], ("lm_head": [D, V] when untied),
     "layers": {"sliding": {name: [n_sliding, ...]}, "global": {name: [n_global, ...]}}}
Layer tensors are stacked on a leading axis per attention kind, so one `lax.scan` covers all layers
even when sliding and global layers have different shapes (Gemma 4). A family may split a kind into
further groups (`ModelConfig.layer_groups`, e.g. Gemma 4's KV-sharing layers, which have no K/V
weights and a wider MLP, or Qwen3-MoE's dense layers among routed ones); each group is then its own
stack.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import jax

from jaxllm.config.model import AttnSpec, ModelConfig
from jaxllm.model.schedule import Branch, branches


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, for sharding rules
    n_contract: int = 0  # >0: a matmul weight, int8-quantizable over these dims
    init: str = "normal"  # normal | zeros | ones
    n_batch: int = 0  # leading dims of independent matrices (MoE experts), before
    # the contracted ones; each keeps its own int8 scales
    # How the layer reads it where it does only through the backend's operations, which may then
    # hand it over in a form of their own (`ops.layer_weights`): MATMUL, contracted over its
    # `n_contract` leading dims (`ops.linear`, `linears`, `gated_mlp`); NORM, an RMSNorm's weight
    # (`ops.rms_norm`, `layer_input`, `add_norm`, `close_layer`, `head_prologue`). "": the model
    # reads the array itself.
    role: str = ""


MATMUL, NORM = "matmul", "norm"


def matmul_weight(shape: tuple[int, ...], axes: tuple, n_contract: int = 1) -> ParamSpec:
    """A weight the layer contracts only through the backend's matmuls."""
    return ParamSpec(shape, axes, n_contract, role=MATMUL)


def norm_weight(cfg: ModelConfig, n: int, axis: str = "embed") -> ParamSpec:
    """An RMSNorm weight [n] the layer hands only to the backend's norm operations."""
    return ParamSpec((n,), (axis,), init="zeros" if cfg.norm_offset else "ones", role=NORM)


def attention_params(cfg: ModelConfig, a: AttnSpec, own_kv: bool = True) -> dict[str, ParamSpec]:
    """The attention block's weights; without `own_kv` (a layer attending over an earlier layer's
    cache) no K/V projections and no K norm."""
    D, H, K, hd = cfg.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim
    p = {
        "attn_norm": norm_weight(cfg, D),
        "q": matmul_weight((D, H, hd), ("embed", "q_heads", "head_dim")),
        "o": matmul_weight((H, hd, D), ("q_heads", "head_dim", "embed"), 2),
    }
    if own_kv:
        p["k"] = matmul_weight((D, K, hd), ("embed", "kv_heads", "head_dim"))
        if not a.k_eq_v:
            p["v"] = matmul_weight((D, K, hd), ("embed", "kv_heads", "head_dim"))
    if cfg.qk_norm:
        p["q_norm"] = norm_weight(cfg, hd, "head_dim")
        if own_kv:
            p["k_norm"] = norm_weight(cfg, hd, "head_dim")
    return p


def gated_mlp_params(D: int, F: int) -> dict[str, ParamSpec]:
    return {
        "gate": matmul_weight((D, F), ("embed", "mlp")),
        "up": matmul_weight((D, F), ("embed", "mlp")),
        "down": matmul_weight((F, D), ("mlp", "embed")),
    }


def moe_params(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The router and the experts stacked on their own axis (`model.moe`), each expert's int8 scales
    its own. The router stays as stored ([E, D], never int8): routing decisions are sensitive."""
    m, D = cfg.moe, cfg.hidden_size
    E, F = m.num_experts, m.intermediate_size
    p = {
        "router": ParamSpec((E, D), ("expert", "embed")),
        "experts_gate_up": ParamSpec((E, D, 2, F), ("expert", "embed", None, "moe_mlp"), 1, n_batch=1),
        "experts_down": ParamSpec((E, F, D), ("expert", "moe_mlp", "embed"), 1, n_batch=1),
    }
    if m.router_norm:
        p["router_scale"] = ParamSpec((D,), ("embed",), init="ones")
    if m.expert_scale:
        p["expert_scale"] = ParamSpec((E,), ("expert",), init="ones")
    return p


def mlp_params(cfg: ModelConfig, width: int | None = None, routed: bool = False) -> dict[str, ParamSpec]:
    """The feed-forward block's norms and weights: a gated MLP `width` wide (default: the
    config's), or routed experts, and the sandwich norms."""
    D = cfg.hidden_size
    p = {"mlp_norm": norm_weight(cfg, D)}
    p.update(moe_params(cfg) if routed else gated_mlp_params(D, width or cfg.intermediate_size))
    if cfg.sandwich_norms:
        p["post_attn_norm"] = norm_weight(cfg, D)
        p["post_mlp_norm"] = norm_weight(cfg, D)
    return p


def layer_params(cfg: ModelConfig, b: Branch) -> dict[str, ParamSpec]:
    return {**attention_params(cfg, cfg.attn[b.kind]), **mlp_params(cfg, routed=b.routed)}


def stack(spec: ParamSpec, n: int) -> ParamSpec:
    return replace(spec, shape=(n, *spec.shape), axes=("layers", *spec.axes))


def abstract_weights(cfg: ModelConfig, layer_fn: Callable = layer_params, extra_top=None) -> dict:
    """The full weight description, each layer group's weights (`layer_fn(cfg, branch)`) stacked
    over its layers; a family may pass its own `layer_fn` and extra top-level specs."""
    V, D = cfg.vocab_size, cfg.hidden_size
    norm_init = "zeros" if cfg.norm_offset else "ones"
    layers = {}
    for b in branches(cfg):
        n = sum(1 for i in range(cfg.num_layers) if cfg.group_of(i) == b.group)
        layers[b.group] = {name: stack(s, n) for name, s in layer_fn(cfg, b).items()}
    tree = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "final_norm": ParamSpec((D,), ("embed",), init=norm_init),
        "layers": layers,
    }
    if not cfg.tie_embeddings:
        tree["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), 1)
    if extra_top:
        tree.update(extra_top)
    return tree


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def map_specs(fn, tree):
    return jax.tree_util.tree_map(fn, tree, is_leaf=is_spec)
