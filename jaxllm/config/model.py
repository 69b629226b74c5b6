"""Model configuration shared by every family.

A family file maps its config.json onto `ModelConfig`; everything downstream (weights, caches, the
layer scan) reads only this. Attention comes in at most two kinds, sliding and global, each with its
own `AttnSpec`, because Gemma 4 gives them different head counts and head sizes. Routed experts, where
a family has them, are one `MoeSpec`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SLIDING, GLOBAL = 0, 1
KIND_NAMES = ("sliding", "global")
CTX_CAP = 8192  # the longest KV length a run gets where none is asked


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10_000.0
    kind: str = "default"  # default | linear | proportional
    factor: float = 1.0  # linear: positions are divided by it
    partial: float = 1.0  # fraction of head_dim that rotates


@dataclass(frozen=True)
class AttnSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec = RopeSpec()
    window: int | None = None  # sliding window (keys with pos > q_pos - window); None = global
    k_eq_v: bool = False  # Gemma 4 global layers: V is the raw K projection


@dataclass(frozen=True)
class MoeSpec:
    """Routed experts (`model.moe`): a router picks `top_k` of `num_experts` gated MLPs of width
    `intermediate_size` for each token. The families' routers differ only in the switches below."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk: bool = True  # the top-k probabilities rescaled to sum to one
    router_norm: bool = False  # the router reads rms_norm(x) * a learned scale / sqrt(D) (Gemma 4)
    expert_scale: bool = False  # a learned factor per expert on its routing weight (Gemma 4)
    dense_layers: tuple[int, ...] = ()  # layers with a plain gated MLP instead (Qwen3-MoE)


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_kinds: tuple[int, ...]  # SLIDING or GLOBAL per layer
    attn: tuple[AttnSpec | None, AttnSpec | None]  # indexed by kind; None where unused
    norm_eps: float = 1e-6
    norm_offset: float = 0.0  # Gemma scales by (1 + w)
    sandwich_norms: bool = False  # Gemma: post-attention and post-MLP norms
    qk_norm: bool = True
    v_norm: bool = False  # Gemma 4: parameter-free RMS norm on V
    activation: str = "silu"  # silu | gelu_tanh
    embed_scale: float | None = None  # Gemma: sqrt(hidden_size), in the compute dtype
    query_scale: float = 1.0  # multiplies q before q.k
    attn_softcap: float | None = None
    final_softcap: float | None = None
    tie_embeddings: bool = True
    max_position: int = 8192
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    extras: tuple[tuple[str, object], ...] = field(default=())  # family-specific static values
    # Layers whose weights differ in shape from others of their kind live in their own stack
    # ("group"); a layer may also read another layer's KV cache instead of keeping its own.
    layer_groups: tuple[str, ...] = ()  # weight stack per layer; () = named after its kind
    kv_sources: tuple[int, ...] = ()  # layer whose KV cache each layer attends over; () = itself
    moe: MoeSpec | None = None  # routed experts, in every layer but `moe.dense_layers`

    # -- derived -------------------------------------------------------------------------------
    @property
    def default_ctx(self) -> int:
        """The KV length a run gets where none is asked: the model's maximum, capped at CTX_CAP."""
        return min(self.max_position, CTX_CAP)

    @property
    def kinds_used(self) -> tuple[int, ...]:
        return tuple(k for k in (SLIDING, GLOBAL) if k in self.layer_kinds)

    def layers_of_kind(self, kind: int) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    def group_of(self, layer: int) -> str:
        return self.layer_groups[layer] if self.layer_groups else KIND_NAMES[self.layer_kinds[layer]]

    def kv_source(self, layer: int) -> int:
        return self.kv_sources[layer] if self.kv_sources else layer

    def routed(self, layer: int) -> bool:
        """Whether the layer has routed experts."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def cache_layers(self, kind: int) -> int:
        """How many KV cache stacks this kind needs: layers reading another layer's cache need none."""
        return sum(1 for i, k in enumerate(self.layer_kinds) if k == kind and self.kv_source(i) == i)

    def extra(self, name: str, default=None):
        return dict(self.extras).get(name, default)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)
