"""Gemma 3 text: (1+w) RMSNorms around attention and MLP, sqrt(D) embedding scale,
query_pre_attn_scalar, GELU-tanh, interleaved sliding/global layers with their own RoPE."""

from __future__ import annotations

from jaxllm.config.model import AttnSpec, ModelConfig
from jaxllm.model.families.common import GEMMA_NORM_NAMES, HF_NAMES, eos_ids, layer_kinds, need, per_kind_rope
from jaxllm.model.params import abstract_weights

MODEL_TYPES = ("gemma3", "gemma3_text")
ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")

NAMES = {**HF_NAMES, **GEMMA_NORM_NAMES}


def hf_name(param: str, layer: int | None) -> str:
    return NAMES[param].format(i=layer)


def config_from_hf(hf: dict, generation: dict | None = None) -> ModelConfig:
    if "text_config" in hf:  # multimodal checkpoint: the text tower's config
        hf = {**hf["text_config"], "eos_token_id": hf["text_config"].get("eos_token_id", hf.get("eos_token_id"))}
    n = int(need(hf, "num_hidden_layers"))
    heads = int(need(hf, "num_attention_heads"))
    D = int(need(hf, "hidden_size"))
    hd = int(hf.get("head_dim") or D // heads)
    kv = int(hf.get("num_key_value_heads") or heads)
    local, glob = per_kind_rope(hf, 1_000_000.0, 10_000.0)
    window = int(hf.get("sliding_window") or 4096)
    kinds = layer_kinds(hf, n, int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))))
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return ModelConfig(
        family="gemma3",
        vocab_size=int(need(hf, "vocab_size")),
        hidden_size=D,
        intermediate_size=int(need(hf, "intermediate_size")),
        num_layers=n,
        layer_kinds=kinds,
        attn=(AttnSpec(heads, kv, hd, local, window=window), AttnSpec(heads, kv, hd, glob)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        norm_offset=1.0,
        sandwich_norms=True,
        qk_norm=True,
        activation="gelu_tanh" if "gelu" in act else act,
        embed_scale=D**0.5,
        query_scale=float(hf.get("query_pre_attn_scalar", hd)) ** -0.5,
        # Gemma 3 configs carry attn_logit_softcapping, but the reference model never applies it.
        attn_softcap=None,
        final_softcap=hf.get("final_logit_softcapping"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        max_position=int(hf.get("max_position_embeddings", 32768)),
        bos_id=hf.get("bos_token_id", 2),
        eos_ids=eos_ids(hf.get("eos_token_id", 1), (generation or {}).get("eos_token_id")),
        pad_id=int(hf.get("pad_token_id") or 0),
    )


def abstract(cfg: ModelConfig) -> dict:
    return abstract_weights(cfg)


# Used when a checkpoint (e.g. a GGUF file) carries no template of its own.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{% if role == 'system' %}{% set role = 'user' %}{% endif %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
