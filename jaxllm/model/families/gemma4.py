"""Gemma 4 text (31B dense, 26B-A4B MoE, E4B/E2B): what differs from the shared core.

- Plain-w RMSNorms (no 1+w), sandwich norms, learned Q/K norms and a parameter-free V norm,
  attention scale 1.0, a learned per-layer output scalar, final logit softcap.
- Global layers have their own head size and KV heads, partial "proportional" RoPE, and with
  `attention_k_eq_v` no v_proj: V is the raw K projection (before k_norm and RoPE).
- 26B-A4B: beside the dense MLP, a routed MoE block (see `moe_block`), its output normed and added.
- E4B/E2B: per-layer input embeddings (PLE) fed to every layer through the scan's per-layer inputs,
  and KV-shared layers: the last `num_kv_shared_layers` layers attend over the cache of the last
  earlier layer of their kind, keep no cache and no K/V weights, and (`use_double_wide_mlp`) have a
  twice-as-wide MLP; they form their own weight stacks ("sliding_shared", "global_shared").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config.model import GLOBAL, KIND_NAMES, SLIDING, AttnSpec, ModelConfig, MoeSpec, RopeSpec
from jaxllm.errors import ModelError
from jaxllm.model.families.common import GEMMA_NORM_NAMES, HF_NAMES, eos_ids, layer_kinds, need, per_kind_rope
from jaxllm.model.layers import attention_block
from jaxllm.model.moe import routed_mlp
from jaxllm.model.params import ParamSpec, abstract_weights, attention_params, matmul_weight, mlp_params, moe_params
from jaxllm.model.schedule import Branch
from jaxllm.ops.xla import activation, rms_norm

# "unified" (Gemma 4 12B) is the same text model without per-layer inputs and MoE
MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
ARCHITECTURES = (
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForCausalLM",
    "Gemma4UnifiedForConditionalGeneration",
)

NAMES = {
    **HF_NAMES,
    **GEMMA_NORM_NAMES,
    "ple_embed": "embed_tokens_per_layer.weight",
    "ple_proj": "per_layer_model_projection.weight",
    "ple_norm": "per_layer_projection_norm.weight",
    "layer_scalar": "layers.{i}.layer_scalar",
    "router": "layers.{i}.router.proj.weight",
    "router_scale": "layers.{i}.router.scale",
    "expert_scale": "layers.{i}.router.per_expert_scale",
    "experts_gate_up": "layers.{i}.experts.gate_up_proj",
    "experts_down": "layers.{i}.experts.down_proj",
    "dense_out_norm": "layers.{i}.post_feedforward_layernorm_1.weight",
    "moe_norm": "layers.{i}.pre_feedforward_layernorm_2.weight",
    "moe_out_norm": "layers.{i}.post_feedforward_layernorm_2.weight",
    "ple_gate": "layers.{i}.per_layer_input_gate.weight",
    "ple_out": "layers.{i}.per_layer_projection.weight",
    "ple_post_norm": "layers.{i}.post_per_layer_input_norm.weight",
}

SHARED_SUFFIX = "_shared"


def hf_name(param: str, layer: int | None) -> str:
    return NAMES[param].format(i=layer)


# -- config -------------------------------------------------------------------------------------
def _global_attention_shape(hf: dict, kinds, heads_kv: int) -> tuple[int, int]:
    """(head_dim, kv heads) of the global layers, from `per_layer_config` (what transformers writes)
    or from `global_head_dim` / `num_global_key_value_heads` (what the released configs carry)."""
    plc = hf.get("per_layer_config")
    if isinstance(plc, dict) and plc:
        over = {int(i): dict(v or {}) for i, v in plc.items()}
        glob = {tuple(sorted(over.get(i, {}).items())) for i, k in enumerate(kinds) if k == GLOBAL}
        slid = [i for i, k in enumerate(kinds) if k == SLIDING and over.get(i)]
        if len(glob) != 1 or slid:
            raise ModelError(
                "config.json: per_layer_config must give every global layer the same overrides and no sliding layer any"
            )
        g = dict(next(iter(glob)))
        return int(g.get("head_dim", hf.get("head_dim", 256))), int(g.get("num_key_value_heads", heads_kv))
    gkv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
    return int(hf.get("global_head_dim") or 512), int(gkv or heads_kv)


def _kv_sources(kinds, n_shared: int) -> tuple[int, ...]:
    n = len(kinds)
    first = n - n_shared
    if not 0 <= n_shared < n:
        raise ModelError(f"config.json: num_kv_shared_layers={n_shared} must lie in [0, {n})")
    out = list(range(n))
    for i in range(first, n):
        earlier = [j for j in range(first) if kinds[j] == kinds[i]]
        if not earlier:
            raise ModelError(
                f"config.json: KV-shared layer {i} has no earlier {KIND_NAMES[kinds[i]]} layer to share with"
            )
        out[i] = earlier[-1]
    return tuple(out)


def config_from_hf(hf: dict, generation: dict | None = None) -> ModelConfig:
    if "text_config" in hf:  # multimodal checkpoint: the text tower's config
        text = hf["text_config"]
        hf = {**text, "eos_token_id": list(eos_ids(text.get("eos_token_id"), hf.get("eos_token_id")))}
    if hf.get("use_bidirectional_attention") == "all":
        raise ModelError("bidirectional Gemma 4 text models (use_bidirectional_attention='all') are not supported")
    n = int(need(hf, "num_hidden_layers"))
    heads = int(need(hf, "num_attention_heads"))
    D = int(need(hf, "hidden_size"))
    hd = int(hf.get("head_dim") or 256)
    kv = int(hf.get("num_key_value_heads") or heads)
    kinds = list(layer_kinds(hf, n, int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))))
    kinds[-1] = GLOBAL  # transformers forces the last layer global
    kinds = tuple(kinds)
    ghd, gkv = _global_attention_shape(hf, kinds, kv)
    if hf.get("rope_parameters"):
        local, glob = per_kind_rope(hf, 1_000_000.0, 10_000.0)
    else:
        local, glob = RopeSpec(10_000.0), RopeSpec(1_000_000.0, "proportional", partial=0.25)
    window = int(hf.get("sliding_window") or 512)
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    n_shared = int(hf.get("num_kv_shared_layers") or 0)
    sources = _kv_sources(kinds, n_shared)
    groups = tuple(KIND_NAMES[k] + (SHARED_SUFFIX if sources[i] != i else "") for i, k in enumerate(kinds))
    extras = [("double_wide_mlp", bool(hf.get("use_double_wide_mlp", False)) and n_shared > 0)]
    moe = None
    if hf.get("enable_moe_block"):
        f_moe = hf.get("moe_intermediate_size") or hf.get("expert_intermediate_size")
        if not f_moe:
            raise ModelError("config.json lacks required field 'moe_intermediate_size'")
        E, k = int(need(hf, "num_experts")), int(need(hf, "top_k_experts"))
        moe = MoeSpec(E, k, int(f_moe), norm_topk=True, router_norm=True, expert_scale=True)
    if hf.get("hidden_size_per_layer_input"):
        extras.append(
            (
                "ple",
                (
                    int(hf["hidden_size_per_layer_input"]),
                    int(hf.get("vocab_size_per_layer_input") or need(hf, "vocab_size")),
                ),
            )
        )
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return ModelConfig(
        family="gemma4",
        vocab_size=int(need(hf, "vocab_size")),
        hidden_size=D,
        intermediate_size=int(need(hf, "intermediate_size")),
        num_layers=n,
        layer_kinds=kinds,
        attn=(AttnSpec(heads, kv, hd, local, window=window), AttnSpec(heads, gkv, ghd, glob, k_eq_v=k_eq_v)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        norm_offset=0.0,
        sandwich_norms=True,
        qk_norm=True,
        v_norm=True,
        activation="gelu_tanh" if "gelu" in act else act,
        embed_scale=D**0.5,
        query_scale=1.0,
        attn_softcap=None,
        final_softcap=hf.get("final_logit_softcapping"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        max_position=int(hf.get("max_position_embeddings", 131072)),
        bos_id=hf.get("bos_token_id", 2),
        eos_ids=eos_ids(hf.get("eos_token_id", 1), (generation or {}).get("eos_token_id")),
        pad_id=int(hf.get("pad_token_id") or 0),
        extras=tuple(extras),
        layer_groups=groups if n_shared else (),
        kv_sources=sources if n_shared else (),
        moe=moe,
    )


# -- weights ------------------------------------------------------------------------------------
def _norm(n: int, axis: str = "embed") -> ParamSpec:
    """An RMSNorm weight that this family's own code applies (the MoE block's, the PLE's)."""
    return ParamSpec((n,), (axis,), init="ones")


def layer_params(cfg: ModelConfig, b: Branch) -> dict[str, ParamSpec]:
    """The shared layer's weights (a KV-sharing layer's without K/V, its MLP twice as wide with
    `double_wide_mlp`), the output scalar, and those of the MoE block beside the MLP and the PLE."""
    D = cfg.hidden_size
    wide = cfg.extra("double_wide_mlp") and not b.own_kv
    p = {
        **attention_params(cfg, cfg.attn[b.kind], own_kv=b.own_kv),
        **mlp_params(cfg, cfg.intermediate_size * (2 if wide else 1)),
        "layer_scalar": ParamSpec((1,), (None,), init="ones"),
    }
    if b.routed:
        p.update(moe_params(cfg))
        p.update({"dense_out_norm": _norm(D), "moe_norm": _norm(D), "moe_out_norm": _norm(D)})
    if cfg.extra("ple"):
        P, _ = cfg.extra("ple")
        p.update(
            {
                "ple_gate": matmul_weight((D, P), ("embed", None)),
                "ple_out": matmul_weight((P, D), (None, "embed")),
                "ple_post_norm": _norm(D),
            }
        )
    return p


def abstract(cfg: ModelConfig) -> dict:
    top = {}
    if cfg.extra("ple"):
        P, Vp = cfg.extra("ple")
        L, D = cfg.num_layers, cfg.hidden_size
        top = {
            "ple_embed": ParamSpec((Vp, L * P), ("vocab", None)),
            "ple_proj": matmul_weight((D, L, P), ("embed", None, None)),
            "ple_norm": _norm(P, None),
        }
    return abstract_weights(cfg, layer_params, extra_top=top)


# -- the forward hooks the core calls -----------------------------------------------------------
def layer_inputs(cfg: ModelConfig, weights: dict, tokens: jax.Array, x: jax.Array, ops):
    """Per-layer inputs [L, B, T, P]: the token's own PLE row plus a projection of its embedding."""
    if not cfg.extra("ple"):
        return None
    P, _ = cfg.extra("ple")
    B, T = tokens.shape
    L, D, dt = cfg.num_layers, cfg.hidden_size, x.dtype
    tok = jnp.take(weights["ple_embed"], tokens, axis=0).astype(dt) * jnp.asarray(P**0.5, dt)
    proj = ops.linear(x, weights["ple_proj"]) * jnp.asarray(D**-0.5, dt)
    proj = rms_norm(proj, weights["ple_norm"], cfg.norm_eps)
    ple = (proj + tok.reshape(B, T, L, P)) * jnp.asarray(2.0**-0.5, dt)
    return jnp.moveaxis(ple, 2, 0)


def moe_block(cfg: ModelConfig, w: dict, x: jax.Array) -> jax.Array:
    """The routed experts' contribution for residual stream x [B, T, D]: routed on x itself, the
    experts fed x normed with their own norm."""
    h = rms_norm(x, w["moe_norm"], cfg.norm_eps)
    y = routed_mlp(cfg.moe, w, h, cfg.activation, cfg.norm_eps, route_on=x)
    return rms_norm(y, w["moe_out_norm"], cfg.norm_eps)


def decoder_layer(cfg: ModelConfig, b: Branch, w: dict, x, h, positions, layer_cache, ple, ops):
    """The shared layer plus Gemma 4's own: the MoE block beside the dense MLP, the per-layer input
    (PLE) and the layer's output scalar; -> (x', x' normed for the next layer), the cache."""
    eps = cfg.norm_eps
    h = ops.layer_input(x, h, w["attn_norm"], eps)
    a, layer_cache = attention_block(cfg, b.kind, w, h, positions, layer_cache, ops, own_kv=b.own_kv, partials=True)
    x, h = ops.add_norm(x, a, w["post_attn_norm"], w["mlp_norm"], eps)
    m = ops.gated_mlp(h, w["gate"], w["up"], w["down"], cfg.activation)
    if b.routed:
        m = rms_norm(m, w["dense_out_norm"], eps) + moe_block(cfg, w, x)
    x = x + ops.rms_norm(m, w["post_mlp_norm"], eps)
    if ple is not None:
        g = activation(cfg.activation, ops.linear(x, w["ple_gate"])) * ple
        x = x + rms_norm(ops.linear(g, w["ple_out"]), w["ple_post_norm"], eps)
    x = x * w["layer_scalar"].astype(x.dtype)
    return ops.next_input(x, w["next_norm"], eps), layer_cache


# Used when a checkpoint carries no template of its own: Gemma 4's turn markup.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n{{ message['content'] | trim }}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
