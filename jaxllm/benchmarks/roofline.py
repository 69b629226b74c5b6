"""What one decode step must move and compute, counted from the weights and the config.

Bytes per step (the HBM roofline): every weight byte once (int8 values plus their scales, or the
bf16/f32 arrays, exactly as the pytree holds them), except that lookup tables (an untied token
embedding, per-layer input embeddings: a leading "vocab" axis and no matmul use) are only gathered,
batch rows of them, while a tied embedding is read whole as the output projection; plus each layer's
K and V over the positions it attends at that context: global layers over ctx, sliding layers over
min(ctx, window), and a layer whose V is its K (k_eq_v) reads one tensor where the pool keeps
values alone and rebuilds the keys from them. Mixture-of-experts weights (a spec axis named "expert") count
only the experts a batch can be expected to touch.

FLOPs per step (the compute roofline): 2 per multiply-add of every matmul weight (the tied
embedding as the output projection included) per row, plus QK^T and PV over the attended positions.
FLOPs of a prefill (for its MFU): the same for every prompt token, the output projection once a
row, and attention over the causal pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxllm.config.model import ModelConfig
from jaxllm.model.params import is_spec


@dataclass(frozen=True)
class StepCost:
    weight_bytes: int
    kv_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def nbytes(x) -> int:
    """Bytes of an array, a ShapeDtypeStruct, or a pytree of them (QuantArray: values + scales)."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(x))


EXPERT_AXES = ("expert", "experts")


def expert_fraction(spec, cfg: ModelConfig, batch: int, for_flops: bool) -> float:
    """Share of an expert-stacked weight a step uses: k/E of the FLOPs, and for bytes the expected
    share of experts at least one of batch*k uniform picks lands on."""
    axis = next((i for i, name in enumerate(spec.axes) if name in EXPERT_AXES), None) if spec else None
    k = cfg.moe.top_k if cfg.moe else None
    if axis is None or not k:
        return 1.0
    E = spec.shape[axis]
    if for_flops:
        return k / E
    return 1.0 - (1.0 - k / E) ** batch


def _spec_at(specs, keys):
    node = specs
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node if is_spec(node) else None


def is_lookup_table(cfg: ModelConfig, keys: list, spec) -> bool:
    if keys == ["embed"]:
        return not cfg.tie_embeddings
    return spec is not None and not spec.n_contract and bool(spec.axes) and spec.axes[0] == "vocab"


def weight_bytes_per_step(cfg: ModelConfig, weights, batch: int, specs=None) -> int:
    """Weight bytes one decode step reads; `weights` may be arrays or ShapeDtypeStructs, and `specs`
    (the family's abstract tree) marks lookup tables beyond the token embedding and MoE experts."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]:
        keys = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        spec = _spec_at(specs, keys)
        b = nbytes(leaf)
        if is_lookup_table(cfg, keys, spec):
            b = min(b, batch * nbytes(leaf) // leaf.shape[0])
        total += b * expert_fraction(spec, cfg, batch, for_flops=False)
    return int(round(total))


def attended(cfg: ModelConfig, kind: int, ctx: int) -> int:
    w = cfg.attn[kind].window
    return min(ctx, w) if w else ctx


def kv_bytes_per_step(
    cfg: ModelConfig, batch: int, ctx: int, kv_itemsize: float | dict = 2, shared: bool = True
) -> int:
    """K/V bytes every layer reads at context ctx (kv_itemsize: bytes per cached element, or a dict
    of them per layer kind). `shared`: k_eq_v layers store one tensor (values alone, keys rebuilt
    from them)."""
    total = 0.0
    for kind in cfg.layer_kinds:
        a = cfg.attn[kind]
        tensors = 1 if a.k_eq_v and shared else 2
        item = kv_itemsize[kind] if isinstance(kv_itemsize, dict) else kv_itemsize
        total += batch * attended(cfg, kind, ctx) * a.num_kv_heads * a.head_dim * item * tensors
    return int(round(total))


def weight_macs(cfg: ModelConfig, specs) -> float:
    """Multiply-adds of every matmul weight for one token (the tied embedding as the output
    projection included; k/E of mixture-of-experts weights)."""
    macs = 0.0
    for spec in jax.tree_util.tree_leaves(specs, is_leaf=is_spec):
        if spec.n_contract:
            macs += np.prod(spec.shape) * expert_fraction(spec, cfg, 1, for_flops=True)
    if cfg.tie_embeddings:
        macs += cfg.vocab_size * cfg.hidden_size
    return macs


def flops_per_step(cfg: ModelConfig, specs, batch: int, ctx: int) -> int:
    """FLOPs of one decode step for `batch` rows at context ctx, from the abstract weight specs."""
    attn = sum(2 * cfg.attn[k].num_heads * cfg.attn[k].head_dim * attended(cfg, k, ctx) for k in cfg.layer_kinds)
    return int(round(2 * batch * (weight_macs(cfg, specs) + attn)))


def causal_pairs(n: int, window: int | None) -> int:
    """(query, key) pairs a causal prompt of n tokens attends, each query over at most `window` keys."""
    w = n if window is None else min(window, n)
    return w * (w + 1) // 2 + (n - w) * w


def prefill_flops(cfg: ModelConfig, specs, batch: int, n: int) -> int:
    """FLOPs of prefilling `batch` prompts of n tokens: every matmul weight for each token but the
    output projection, which only the last token of a row goes through, and QK^T and PV over the
    causal pairs (within the window on sliding layers). The model's FLOPs, for MFU: masked-out
    work an implementation does is not counted."""
    head = cfg.vocab_size * cfg.hidden_size
    attn = sum(
        2 * cfg.attn[k].num_heads * cfg.attn[k].head_dim * causal_pairs(n, cfg.attn[k].window) for k in cfg.layer_kinds
    )
    return int(round(2 * batch * (n * (weight_macs(cfg, specs) - head) + head + attn)))


def step_cost(
    cfg: ModelConfig, weights, specs, batch: int, ctx: int, kv_itemsize: float | dict = 2, shared: bool = True
) -> StepCost:
    return StepCost(
        weight_bytes_per_step(cfg, weights, batch, specs),
        kv_bytes_per_step(cfg, batch, ctx, kv_itemsize, shared),
        flops_per_step(cfg, specs, batch, ctx),
    )
