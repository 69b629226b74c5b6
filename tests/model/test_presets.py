"""Shape presets: every packaged config maps to the architecture it names, and a shrunk preset
builds and runs with random (int8) weights."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxllm
from jaxllm import ModelError
from jaxllm.config.model import GLOBAL, SLIDING, MoeSpec
from jaxllm.model.params import is_spec
from jaxllm.model.presets import load_preset, names

# Published parameter counts of the text models (embeddings included; the E models' published
# totals also hold their vision/audio towers, hence the looser bound there).
PARAMS_B = {"gemma4-31b": (30.6, 30.8), "gemma4-26b-a4b": (25.1, 25.3), "gemma4-e4b": (7.3, 8.0),
            "gemma4-e2b": (4.5, 5.1), "gemma3-270m": (0.26, 0.28), "qwen3-0.6b": (0.59, 0.61),
            "qwen3-4b": (4.0, 4.05), "qwen3-8b": (8.1, 8.3), "qwen3-32b": (32.7, 32.9),
            "qwen3-30b-a3b": (30.4, 30.6), "qwen3-235b-a22b": (234.5, 235.5)}


def n_params(cfg, fam) -> float:
    leaves = jax.tree_util.tree_leaves(fam.abstract(cfg), is_leaf=is_spec)
    return sum(int(np.prod(s.shape)) for s in leaves) / 1e9


def test_all_presets_are_packaged():
    expected = {"gemma4-31b", "gemma4-26b-a4b", "gemma4-e4b", "gemma4-e2b", "gemma4-12b", "gemma3-270m",
                "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b",
                "qwen3-235b-a22b"}
    assert expected <= set(names())


@pytest.mark.parametrize("name", sorted(PARAMS_B))
def test_preset_parameter_count(name):
    lo, hi = PARAMS_B[name]
    assert lo <= n_params(*load_preset(name)) <= hi


def test_gemma4_31b_shape():
    cfg, fam = load_preset("gemma4-31b")
    assert fam.__name__.endswith("gemma4")
    assert (cfg.layers_of_kind(SLIDING), cfg.layers_of_kind(GLOBAL)) == (50, 10)
    s, g = cfg.attn
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.window, s.rope.theta) == (32, 16, 256, 1024, 10_000.0)
    assert (g.num_kv_heads, g.head_dim, g.k_eq_v, g.rope.kind, g.rope.partial) == (4, 512, True, "proportional", 0.25)
    assert cfg.final_softcap == 30.0 and cfg.query_scale == 1.0 and cfg.norm_offset == 0.0


def test_gemma4_moe_and_per_layer_presets():
    cfg, _ = load_preset("gemma4-26b-a4b")
    assert cfg.moe == MoeSpec(128, 8, 704, norm_topk=True, router_norm=True, expert_scale=True)
    e2b, _ = load_preset("gemma4-e2b")
    assert e2b.extra("ple") == (256, 262144) and e2b.extra("double_wide_mlp")
    # 35 layers, the last 20 share: 15 keep caches (12 sliding, 3 global)
    assert (e2b.cache_layers(SLIDING), e2b.cache_layers(GLOBAL)) == (12, 3)
    assert e2b.kv_source(34) == 14 and e2b.kv_source(33) == 13
    e4b, _ = load_preset("gemma4-e4b")
    assert (e4b.cache_layers(SLIDING), e4b.cache_layers(GLOBAL)) == (20, 4)


def test_other_families():
    assert load_preset("qwen3-4b")[1].__name__.endswith("qwen3")
    for name, (E, k, F) in {"qwen3-30b-a3b": (128, 8, 768), "qwen3-235b-a22b": (128, 8, 1536)}.items():
        cfg, fam = load_preset(name)
        assert fam.__name__.endswith("qwen3") and cfg.moe == MoeSpec(E, k, F, norm_topk=True)
        assert cfg.layer_groups == () and cfg.layer_kinds == (GLOBAL,) * cfg.num_layers
    cfg, fam = load_preset("gemma3-270m")
    assert fam.__name__.endswith("gemma3") and cfg.layer_kinds.count(GLOBAL) == 3


def test_unknown_preset_is_a_model_error():
    with pytest.raises(ModelError, match="unknown shape .gemma4-999b. \\(known: "):
        load_preset("gemma4-999b")


SHRINK = dict(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              global_head_dim=32, num_global_key_value_heads=1, vocab_size=512, sliding_window=4,
              num_experts=8, top_k_experts=2, expert_intermediate_size=16)


def test_random_int8_engine_runs_shrunk_moe_preset():
    eng = jaxllm.load(shape="gemma4-26b-a4b", dtype="float32", quant="int8", max_ctx=64,
                      shape_overrides={"num_hidden_layers": 6, **SHRINK})
    experts = eng.weights["layers"]["sliding"]["experts_gate_up"]
    assert experts.q.dtype == np.int8 and experts.q.shape == (5, 8, 64, 2, 16)
    assert experts.scale.shape == (5, 8, 2, 16)           # per layer, expert and output channel
    logits = eng.logits([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    assert logits.shape == (2, 6, 512) and np.all(np.isfinite(logits)) and np.std(logits) > 0
