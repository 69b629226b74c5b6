"""Qwen3: GQA with per-head Q/K RMSNorm, SwiGLU, RoPE; plain pre-norm residual blocks.

Qwen3-MoE (30B-A3B, 235B-A22B) is the same model, its chat, tool-call and reasoning markup too,
with routed experts in place of the MLP (`model.moe`; no shared expert): softmax over all experts,
the top k, renormalized where `norm_topk_prob`. Layers in `mlp_only_layers`, or off every
`decoder_sparse_step`-th, keep a dense MLP, in a weight stack of their own ("global_dense").
Published checkpoints store each expert's projections apart, transformers' `save_pretrained` too;
the loader stacks them (`weights.safetensors_source.ExpertsStacked`).
"""

from __future__ import annotations

from jaxllm.config.model import GLOBAL, KIND_NAMES, SLIDING, AttnSpec, ModelConfig, MoeSpec
from jaxllm.model.families.common import HF_NAMES, eos_ids, layer_kinds, need, per_kind_rope
from jaxllm.model.params import abstract_weights

MODEL_TYPES = ("qwen3", "qwen3_moe")
ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

NAMES = {
    **HF_NAMES,
    "mlp_norm": "layers.{i}.post_attention_layernorm.weight",
    "router": "layers.{i}.mlp.gate.weight",
    "experts_gate_up": "layers.{i}.mlp.experts.gate_up_proj",
    "experts_down": "layers.{i}.mlp.experts.down_proj",
}

DENSE_SUFFIX = "_dense"


def hf_name(param: str, layer: int | None) -> str:
    return NAMES[param].format(i=layer)


def is_moe(hf: dict) -> bool:
    return hf.get("model_type") == "qwen3_moe" or "Qwen3MoeForCausalLM" in (hf.get("architectures") or [])


def _moe(hf: dict, n: int) -> MoeSpec | None:
    """Routed experts of a Qwen3-MoE config, the layers that keep a dense MLP named."""
    E = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)  # transformers writes the latter
    step = int(hf.get("decoder_sparse_step") or 1)
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step)
    if not E or len(dense) == n:
        return None
    return MoeSpec(
        num_experts=E,
        top_k=int(need(hf, "num_experts_per_tok")),
        intermediate_size=int(need(hf, "moe_intermediate_size")),
        norm_topk=bool(hf.get("norm_topk_prob", False)),
        dense_layers=dense,
    )


def config_from_hf(hf: dict, generation: dict | None = None) -> ModelConfig:
    n = int(need(hf, "num_hidden_layers"))
    heads = int(need(hf, "num_attention_heads"))
    hd = int(hf.get("head_dim") or need(hf, "hidden_size") // heads)
    _, rope = per_kind_rope(hf, 1_000_000.0, 10_000.0)
    moe = _moe(hf, n) if is_moe(hf) else None
    kinds = layer_kinds(hf, n, None)
    if hf.get("use_sliding_window") and not hf.get("layer_types"):
        # Qwen3 slides from layer `max_window_layers` on; Qwen3-MoE slides in every layer.
        lo = 0 if is_moe(hf) else int(hf.get("max_window_layers", n))
        kinds = tuple(SLIDING if i >= lo else GLOBAL for i in range(n))
    kv = int(hf.get("num_key_value_heads") or heads)
    glob = AttnSpec(heads, kv, hd, rope)
    slide = AttnSpec(heads, kv, hd, rope, window=hf.get("sliding_window"))
    dense = moe.dense_layers if moe else ()
    groups = tuple(KIND_NAMES[k] + (DENSE_SUFFIX if i in dense else "") for i, k in enumerate(kinds))
    return ModelConfig(
        family="qwen3",
        vocab_size=int(need(hf, "vocab_size")),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(need(hf, "intermediate_size")),
        num_layers=n,
        layer_kinds=kinds,
        attn=(slide, glob),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=True,
        activation="silu",
        query_scale=hd**-0.5,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=int(hf.get("max_position_embeddings", 32768)),
        bos_id=hf.get("bos_token_id"),
        eos_ids=eos_ids(hf.get("eos_token_id"), (generation or {}).get("eos_token_id")),
        pad_id=int(hf.get("pad_token_id") or 0),
        layer_groups=groups if dense else (),
        moe=moe,
    )


def abstract(cfg: ModelConfig) -> dict:
    return abstract_weights(cfg)


CHAT_TEMPLATE = None  # Qwen3 checkpoints carry theirs in tokenizer_config.json
