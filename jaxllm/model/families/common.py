"""Helpers the family files share for reading config.json."""

from __future__ import annotations

from jaxllm.config.model import GLOBAL, SLIDING, RopeSpec
from jaxllm.errors import ModelError

ROPE_TYPES = {"default", "linear", "proportional"}

# Tensor names every supported family shares (Hugging Face's Llama-style layout, under the model
# prefix); a family adds or overrides the rest.
HF_NAMES = {
    "embed": "embed_tokens.weight",
    "final_norm": "norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "layers.{i}.input_layernorm.weight",
    "q": "layers.{i}.self_attn.q_proj.weight",
    "k": "layers.{i}.self_attn.k_proj.weight",
    "v": "layers.{i}.self_attn.v_proj.weight",
    "o": "layers.{i}.self_attn.o_proj.weight",
    "q_norm": "layers.{i}.self_attn.q_norm.weight",
    "k_norm": "layers.{i}.self_attn.k_norm.weight",
    "gate": "layers.{i}.mlp.gate_proj.weight",
    "up": "layers.{i}.mlp.up_proj.weight",
    "down": "layers.{i}.mlp.down_proj.weight",
}

# Gemma's four norms around attention and the MLP.
GEMMA_NORM_NAMES = {
    "post_attn_norm": "layers.{i}.post_attention_layernorm.weight",
    "mlp_norm": "layers.{i}.pre_feedforward_layernorm.weight",
    "post_mlp_norm": "layers.{i}.post_feedforward_layernorm.weight",
}


def need(hf: dict, key: str):
    if key not in hf or hf[key] is None:
        raise ModelError(f"config.json lacks required field '{key}'")
    return hf[key]


def rope_spec(params: dict | None, theta_default: float) -> RopeSpec:
    """A RopeSpec from one HF rope-parameters dict (new style) or rope_scaling (old style)."""
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ModelError(f"unsupported rope_type {kind!r} (supported: {', '.join(sorted(ROPE_TYPES))})")
    return RopeSpec(
        theta=float(params.get("rope_theta", theta_default)),
        kind=kind,
        factor=float(params.get("factor", 1.0)) if kind != "default" else 1.0,
        partial=float(params.get("partial_rotary_factor", 1.0)),
    )


def per_kind_rope(hf: dict, global_theta: float, local_theta: float) -> tuple[RopeSpec, RopeSpec]:
    """(sliding, global) rope specs from any of the layouts transformers has written over time."""
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        return (rope_spec(rp.get("sliding_attention"), local_theta), rope_spec(rp.get("full_attention"), global_theta))
    if isinstance(rp, dict):
        g = rope_spec(rp, hf.get("rope_theta", global_theta))
    else:
        g = rope_spec(hf.get("rope_scaling"), hf.get("rope_theta", global_theta))
    local = RopeSpec(theta=float(hf.get("rope_local_base_freq", local_theta)))
    return local, g


def layer_kinds(hf: dict, n_layers: int, pattern: int | None) -> tuple[int, ...]:
    types = hf.get("layer_types")
    if types:
        if len(types) != n_layers:
            raise ModelError(f"config.json: layer_types has {len(types)} entries for {n_layers} layers")
        bad = set(types) - {"sliding_attention", "full_attention"}
        if bad:
            raise ModelError(f"config.json: unknown layer type(s) {sorted(bad)}")
        return tuple(SLIDING if t == "sliding_attention" else GLOBAL for t in types)
    if pattern:
        return tuple(SLIDING if (i + 1) % pattern else GLOBAL for i in range(n_layers))
    return (GLOBAL,) * n_layers


def eos_ids(*values) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if i is not None and int(i) not in out:
                out.append(int(i))
    return tuple(out)
