"""The GGUF architectures jaxllm reads, as llama.cpp's converter (convert_hf_to_gguf.py) writes
them: each file's metadata as the HF `config.json` dict of the model it was converted from, and
where that model's tensors went.

Tensor names come from the gguf package: its `TensorNameMap` renames a family's HF names the way the
converter's `map_tensor_name` does; `Arch.renamed` holds the few the converter renames by hand. No
architecture here has its Q/K rows permuted (the converter does that for llama-style models only),
so every matrix is the HF one as stored.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import gguf
import numpy as np

from jaxllm.errors import ModelError

T = gguf.MODEL_TENSOR
ARCH_ENUMS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}

# llama.cpp hard-codes these for gemma3 instead of writing them to the file (llama-model.cpp):
# every 6th layer is global, local layers use theta 10k.
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
_LLAMA_CPP_ROPE_THETA = 10_000.0  # what llama.cpp assumes where a file states no rope.freq_base


class Meta:
    """One file's metadata and tensor table, its architecture's keys read without the prefix."""

    def __init__(self, meta: dict, tensors: dict, shown: str):
        self.meta, self.tensors, self.shown = meta, tensors, shown
        self.arch = meta["general.architecture"]

    def get(self, key: str, default=None):
        value = self.meta.get(f"{self.arch}.{key}")
        return default if value is None else value

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelError(f"{self.shown}: GGUF metadata key '{self.arch}.{key}' is missing")
        return value

    def per_layer(self, key: str, n: int, default=None) -> list:
        """A key llama.cpp writes as one value or one per layer, as a per-layer list."""
        value = self.need(key) if default is None else self.get(key, default)
        if not isinstance(value, list):
            return [value] * n
        if len(value) != n:
            raise ModelError(f"{self.shown}: '{self.arch}.{key}' has {len(value)} entries, not {n}")
        return value

    def error(self, what: str) -> ModelError:
        return ModelError(f"{self.shown}: {what}")


def _common(m: Meta) -> dict:
    """What every architecture states the same way."""
    meta = m.meta
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise m.error("GGUF file has no tokenizer.ggml.tokens")
    return {
        # as transformers: the file's vocab_size key if any, else the number of tokens
        "vocab_size": int(m.get("vocab_size") or len(tokens)),
        "hidden_size": int(m.need("embedding_length")),
        "num_hidden_layers": int(m.need("block_count")),
        "num_attention_heads": int(m.need("attention.head_count")),
        # kept as the float32 the file stores (9.99999997e-07), as transformers does
        "rms_norm_eps": float(m.need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(m.need("context_length")),
        # llama.cpp writes output.weight only when the head is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in m.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def _rope(m: Meta, theta: float) -> dict:
    """HF rope parameters of the file's rope.freq_base and rope.scaling.*; a scaling jaxllm does not
    run keeps its name, which the family then refuses."""
    params = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base", theta))}
    kind, factor = m.get("rope.scaling.type"), m.get("rope.scaling.factor")
    if kind not in (None, "none") and factor:
        params.update(rope_type=kind, factor=float(factor))
        if m.get("rope.scaling.original_context_length"):
            params["original_max_position_embeddings"] = int(m.get("rope.scaling.original_context_length"))
    return params


def _sliding(m: Meta, n: int, default: int | None) -> list[str]:
    """HF layer_types from attention.sliding_window_pattern: a bool per layer (True = sliding), or
    an int n as llama.cpp reads it (layer i slides iff n == 0 or i % n < n - 1; for n = 6 that is
    Gemma3TextConfig's own rule, (i + 1) % 6 != 0)."""
    pattern = m.get("attention.sliding_window_pattern", default)
    if pattern is None:
        raise m.error(f"GGUF metadata key '{m.arch}.attention.sliding_window_pattern' is missing")
    if isinstance(pattern, list):
        sliding = [bool(s) for s in m.per_layer("attention.sliding_window_pattern", n)]
    else:
        p = int(pattern)
        sliding = [p == 0 or i % p < p - 1 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def gemma3_config(m: Meta) -> dict:
    """A Gemma3TextConfig dict, as transformers' GGUF path reads the file (but for the marked
    differences)."""
    config = _common(m)
    n, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    head_dim = int(m.need("attention.key_length"))
    # Unlike transformers (whose gemma3 GGUF mapping ignores rope.scaling.*, so it would run a 4B+
    # file with plain RoPE), honour llama.cpp's linear scaling, which like HF applies to global
    # layers only. The embedded 270M file has none, so there both agree.
    full_rope = _rope(m, float(m.need("rope.freq_base")))
    local_theta = float(m.get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA))
    pattern = m.get("attention.sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN)
    config.update(
        {
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "intermediate_size": int(m.need("feed_forward_length")),
            "num_key_value_heads": int(m.need("attention.head_count_kv")),
            "head_dim": head_dim,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
                "full_attention": full_rope,
            },
            # the same thetas under the pre-`rope_parameters` names, for readers of older configs
            "rope_theta": full_rope["rope_theta"],
            "rope_local_base_freq": local_theta,
            "sliding_window": int(m.need("attention.sliding_window")),
            "layer_types": _sliding(m, n, _GEMMA3_SLIDING_WINDOW_PATTERN),
            # Unlike transformers, which leaves query_pre_attn_scalar at its default 256: that equals
            # head_dim for every Gemma 3 but 27B (62 layers), whose HF config has hidden/heads = 168.
            # llama.cpp special-cases 27B the same way; follow it so such a file is right too.
            "query_pre_attn_scalar": hidden // heads if n == 62 else head_dim,
            "final_logit_softcapping": m.get("final_logit_softcapping"),
            "attn_logit_softcapping": m.get("attn_logit_softcapping"),
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False,
            "use_bidirectional_attention": False,
        }
    )
    if isinstance(pattern, int) and pattern > 0:
        config["sliding_window_pattern"] = pattern
    return config


def qwen3_config(m: Meta) -> dict:
    """A Qwen3Config or Qwen3MoeConfig dict (llama.cpp's Qwen3-MoE has no dense layers)."""
    config = _common(m)
    moe = m.arch == "qwen3moe"
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    rope = _rope(m, _LLAMA_CPP_ROPE_THETA)
    config.update(
        {
            "model_type": "qwen3_moe" if moe else "qwen3",
            "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
            # the dense MLP's width; llama.cpp's Qwen3-MoE has none, and may not state it
            "intermediate_size": int(m.get("feed_forward_length") or 0 if moe else m.need("feed_forward_length")),
            "num_key_value_heads": int(m.get("attention.head_count_kv", heads)),
            "head_dim": int(m.get("attention.key_length") or hidden // heads),
            "rope_parameters": rope,
            "rope_theta": rope["rope_theta"],
            "hidden_act": "silu",
            "attention_bias": False,
        }
    )
    if moe:
        config.update(
            {
                "num_experts": int(m.need("expert_count")),
                "num_experts_per_tok": int(m.need("expert_used_count")),
                "moe_intermediate_size": int(m.need("expert_feed_forward_length")),
                # llama.cpp always renormalizes Qwen3-MoE's top-k weights, as every released config does
                "norm_topk_prob": True,
            }
        )
    return config


def _one_per_kind(m: Meta, values: list, layer_types: list[str], what: str) -> dict[str, int]:
    """{layer type: value} of a per-layer key that must be one value per attention kind."""
    out = {}
    for kind in set(layer_types):
        seen = {int(v) for v, t in zip(values, layer_types) if t == kind}
        if len(seen) != 1:
            raise m.error(f"{what} differs between {kind.split('_')[0]} layers ({sorted(seen)})")
        out[kind] = seen.pop()
    return out


def _proportional_share(m: Meta, rope_freqs) -> float:
    """The rotated share of a global head: llama.cpp's converter writes Gemma 4's proportional RoPE
    as rope_freqs factors, 1 for each rotated pair and 1e30 (no rotation) for the rest."""
    if rope_freqs is None:
        raise m.error("GGUF file has no rope_freqs.weight, which gemma4 needs for its global layers' RoPE")
    factors = np.asarray(rope_freqs, np.float32).reshape(-1)
    return float(np.count_nonzero(factors < 1e29) / factors.size)


def gemma4_config(m: Meta) -> dict:
    """A Gemma4TextConfig dict: the global layers' own head size and KV heads (`per_layer_config`,
    as transformers writes it), their proportional RoPE, k_eq_v where their V tensors are absent,
    KV-shared layers, double-wide MLPs, per-layer inputs and the MoE block."""
    config = _common(m)
    n = config["num_hidden_layers"]
    types = _sliding(m, n, None)
    kv = _one_per_kind(m, m.per_layer("attention.head_count_kv", n), types, "attention.head_count_kv")
    shared = int(m.get("attention.shared_kv_layers", 0))
    ff = [int(f) for f in m.per_layer("feed_forward_length", n)]
    double = [ff[0] if i < n - shared else 2 * ff[0] for i in range(n)]
    if ff != [ff[0]] * n and (ff != double or not shared):
        raise m.error(f"per-layer feed_forward_length {ff} is neither uniform nor double in the KV-shared layers")
    rope_freqs = m.tensors.get("rope_freqs.weight")
    glob = [i for i, t in enumerate(types) if t == "full_attention"]
    # llama.cpp's Gemma 4 reads V from K where a layer has no attn_v (HF's attention_k_eq_v)
    k_eq_v = any(f"blk.{i}.attn_v.weight" not in m.tensors for i in glob if i < n - shared)
    ghd = int(m.need("attention.key_length"))
    sliding = {
        "rope_type": "default",
        "rope_theta": float(m.get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA)),
    }
    full = {
        "rope_type": "proportional",
        "partial_rotary_factor": _proportional_share(m, None if rope_freqs is None else rope_freqs.data),
        "rope_theta": float(m.need("rope.freq_base")),
    }
    config.update(
        {
            "model_type": "gemma4_text",
            "architectures": ["Gemma4ForCausalLM"],
            "intermediate_size": ff[0],
            "use_double_wide_mlp": ff != [ff[0]] * n,
            "head_dim": int(m.get("attention.key_length_swa") or ghd),
            "num_key_value_heads": kv.get("sliding_attention", kv["full_attention"]),
            "per_layer_config": {str(i): {"head_dim": ghd, "num_key_value_heads": kv["full_attention"]} for i in glob},
            "attention_k_eq_v": k_eq_v,
            "num_kv_shared_layers": shared,
            "layer_types": types,
            "sliding_window": int(m.need("attention.sliding_window")),
            "rope_parameters": {"sliding_attention": sliding, "full_attention": full},
            "final_logit_softcapping": m.get("final_logit_softcapping"),
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size_per_layer_input": int(m.get("embedding_length_per_layer_input", 0)),
            "enable_moe_block": bool(m.get("expert_count")),
        }
    )
    ple = m.tensors.get("per_layer_token_embd.weight")
    if ple is not None:
        config["vocab_size_per_layer_input"] = int(ple.shape[-1])
    if config["enable_moe_block"]:
        config.update(
            {
                "num_experts": int(m.need("expert_count")),
                "top_k_experts": int(m.need("expert_used_count")),
                "moe_intermediate_size": int(m.need("expert_feed_forward_length")),
            }
        )
    return config


@dataclasses.dataclass(frozen=True)
class Arch:
    config: Callable[[Meta], dict]
    # llama.cpp stores Gemma 3's RMSNorm weights as (1 + w); HF's Gemma3RMSNorm adds the 1 itself
    norm_shift: float = 0.0
    # family params the converter writes under names of its own, as the (tensor, suffix) pieces
    # concatenated along rows
    renamed: dict = dataclasses.field(default_factory=dict)
    # tensors the config reads rather than weights
    config_only: tuple = ()


ARCHS = {
    "gemma3": Arch(gemma3_config, norm_shift=1.0),
    "qwen3": Arch(qwen3_config),
    # each layer's experts as three [E, F, D] / [E, D, F] stacks; HF's gate_up_proj is gate then up
    "qwen3moe": Arch(qwen3_config, renamed={"experts_gate_up": ((T.FFN_GATE_EXP, "weight"), (T.FFN_UP_EXP, "weight"))}),
    # the router's input scale and the per-expert output scale, named by Gemma4Model.modify_tensors
    "gemma4": Arch(
        gemma4_config,
        renamed={"router_scale": ((T.FFN_GATE_INP, "scale"),), "expert_scale": ((T.FFN_DOWN_EXP, "scale"),)},
        config_only=(T.ROPE_FREQS,),
    ),
}


def config_only_names(arch: str) -> set[str]:
    return {f"{gguf.TENSOR_NAMES[t]}.weight" for t in ARCHS[arch].config_only}


def tensor_names(arch: str, family, n_layers: int) -> dict[str, tuple[str, int, int]]:
    """gguf tensor name -> (HF name, piece, pieces) for every tensor a model of `family` reads."""
    renamed = ARCHS[arch].renamed
    tmap = gguf.get_tensor_name_map(ARCH_ENUMS[arch], n_layers)
    out = {}
    for param, pattern in family.NAMES.items():
        for i in range(n_layers) if "{i}" in pattern else [None]:
            hf = pattern.format(i=i) if pattern.startswith("lm_head") else "model." + pattern.format(i=i)
            if param in renamed:
                pieces = [f"{gguf.TENSOR_NAMES[t].format(bid=i)}.{suffix}" for t, suffix in renamed[param]]
            else:
                name = tmap.get_name(hf, try_suffixes=(".weight",))
                if name is None:  # no tensor of this architecture
                    continue
                # the converter names a suffix-less HF tensor (layer_scalar, fused experts) ".weight"
                pieces = [name if name.endswith(".weight") else name + ".weight"]
            for k, name in enumerate(pieces):
                out[name] = (hf, k, len(pieces))
    return out
