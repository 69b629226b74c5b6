"""Run in a subprocess with 4 host devices (XLA_FLAGS must be set before jax is imported):
logits of each case under TP=1, TP=4 and TP=2 x DP=2, and the refusal of an impossible --tp.
Prints one JSON object."""
import json
import os
import sys

# the suite's XLA flags (tests/conftest.py) come with the environment; 4 host devices on top
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import gemma4_refs  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import tiny  # noqa: E402
from tp_models import make  # noqa: E402

import jaxllm  # noqa: E402

# One line per case: (name, function writing the checkpoint to a path). Every case has fewer KV
# heads than TP=4 in at least one layer kind, or exactly as many.
CASES = [
    ("qwen3", lambda p: make("qwen3", p)),
    ("qwen3-kv2", lambda p: make("qwen3", p, num_key_value_heads=2)),
    ("gemma3-kv2", lambda p: make("gemma3", p, num_key_value_heads=2)),
    # Gemma 4: global layers with 1 KV head (k_eq_v), sliding ones with 2; and routed experts
    ("gemma4-31b", lambda p: gemma4_refs.build("31b").save_pretrained(p)),
    ("gemma4-26b-a4b", lambda p: gemma4_refs.build("26b-a4b").save_pretrained(p)),
    # Qwen3-MoE: 4 query heads, 2 KV heads, 8 experts (top 3); layer 1 keeps a dense MLP
    ("qwen3-moe", lambda p: tiny.make("qwen3_moe", p, num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1])),
]
LAYOUTS = [(4, 1), (2, 2)]


def spec_of(w):
    return list(getattr(w, "q", w).sharding.spec)


def main(tmp):
    ids = np.random.default_rng(0).integers(0, 160, (2, 11)).astype(np.int32)   # every vocab >= 160
    out = {}
    for name, write in CASES:
        path = os.path.join(tmp, name)
        write(path)
        ref = jaxllm.load(path, dtype="float32", quant="none", tp=1, max_ctx=32).logits(ids)
        res = {"scale": float(np.abs(ref).max())}
        for tp, dp in LAYOUTS:
            eng = jaxllm.load(path, dtype="float32", quant="none", tp=tp, dp=dp, max_ctx=32)
            layers = eng.weights["layers"]["global"]
            dense = next(g for g in eng.weights["layers"].values() if "down" in g)
            core = eng.core(2, 8)
            cache, plan = core.state.cache, core.plan
            res[f"tp{tp}dp{dp}"] = {
                "plan": [plan.total, plan.device_bytes],
                "allocated": [sum(x.nbytes for x in jax.tree_util.tree_leaves(cache.pools)),
                              sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(cache.pools))],
                "err": float(np.abs(eng.logits(ids) - ref).max()),
                "q": spec_of(layers["q"]), "k": spec_of(layers["k"]), "down": spec_of(dense["down"]),
                "experts": spec_of(layers["experts_gate_up"]) if "experts_gate_up" in layers else None,
                "kv_heads": eng.cfg.attn[1].num_kv_heads,
                "cache": list(cache.pools["global"].k.sharding.spec),
                "tables": (list(cache.tables["global"].sharding.spec) + [None] * 2)[:2],
                "any_split": any("model" in x.sharding.spec for x in jax.tree_util.tree_leaves(cache.pools)),
            }
        out[name] = res
    # the int8 path (routed experts' int8 too) shards the same way and decodes the same greedy tokens
    # under TP=4
    prompts = [[1, 2, 3, 4], [5, 6]]
    for name in ("qwen3", "qwen3-moe"):
        path = os.path.join(tmp, name)
        one = jaxllm.load(path, dtype="float32", tp=1, max_ctx=32).generate_ids(prompts, max_tokens=6)
        four = jaxllm.load(path, dtype="float32", tp=4, max_ctx=32).generate_ids(prompts, max_tokens=6)
        out[f"greedy_int8_{name}"] = {"tp1": [c.token_ids for c in one], "tp4": [c.token_ids for c in four]}
    path = os.path.join(tmp, "qwen3")
    try:
        jaxllm.load(path, tp=3)
        out["tp3_error"] = None
    except jaxllm.ModelError as e:
        out["tp3_error"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
