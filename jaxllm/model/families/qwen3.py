"""Qwen3 dense: GQA with per-head Q/K RMSNorm, SwiGLU, RoPE; plain pre-norm residual blocks."""

from __future__ import annotations

from jaxllm.config.model import GLOBAL, SLIDING, AttnSpec, ModelConfig
from jaxllm.model.families.common import HF_NAMES, eos_ids, layer_kinds, need, per_kind_rope
from jaxllm.model.params import abstract_weights

MODEL_TYPES = ("qwen3",)
ARCHITECTURES = ("Qwen3ForCausalLM",)

NAMES = {**HF_NAMES, "mlp_norm": "layers.{i}.post_attention_layernorm.weight"}


def hf_name(param: str, layer: int | None) -> str:
    return NAMES[param].format(i=layer)


def config_from_hf(hf: dict, generation: dict | None = None) -> ModelConfig:
    n = int(need(hf, "num_hidden_layers"))
    heads = int(need(hf, "num_attention_heads"))
    hd = int(hf.get("head_dim") or need(hf, "hidden_size") // heads)
    _, rope = per_kind_rope(hf, 1_000_000.0, 10_000.0)
    kinds = layer_kinds(hf, n, None)
    if hf.get("use_sliding_window") and not hf.get("layer_types"):
        lo = int(hf.get("max_window_layers", n))
        kinds = tuple(SLIDING if i >= lo else GLOBAL for i in range(n))
    kv = int(hf.get("num_key_value_heads") or heads)
    glob = AttnSpec(heads, kv, hd, rope)
    slide = AttnSpec(heads, kv, hd, rope, window=hf.get("sliding_window"))
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
    )


def abstract(cfg: ModelConfig) -> dict:
    return abstract_weights(cfg)


CHAT_TEMPLATE = None  # Qwen3 checkpoints carry theirs in tokenizer_config.json
