"""Run in a subprocess with 4 host devices (XLA_FLAGS must be set before jax is imported):
logits of each case under TP=1, TP=4 and TP=2 x DP=2, and the refusal of an impossible --tp.
Prints one JSON object."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

import jaxllm  # noqa: E402
from tp_models import make  # noqa: E402

# One line per case: (name, family, config overrides). Every case has fewer KV heads than TP=4 in
# at least one layer kind, or exactly as many. A Gemma 4 case (global layers with 2 KV heads) is
# one more line here once its family is in tp_models.BASE.
CASES = [
    ("qwen3", "qwen3", {}),
    ("qwen3-kv2", "qwen3", {"num_key_value_heads": 2}),
    ("gemma3-kv2", "gemma3", {"num_key_value_heads": 2}),
]
LAYOUTS = [(4, 1), (2, 2)]


def spec_of(w):
    return list(getattr(w, "q", w).sharding.spec)


def main(tmp):
    ids = np.random.default_rng(0).integers(0, 160, (2, 11)).astype(np.int32)
    out = {}
    for name, family, overrides in CASES:
        path = os.path.join(tmp, name)
        make(family, path, **overrides)
        ref = jaxllm.load(path, dtype="float32", quant="none", tp=1, max_ctx=32).logits(ids)
        res = {"scale": float(np.abs(ref).max())}
        for tp, dp in LAYOUTS:
            eng = jaxllm.load(path, dtype="float32", quant="none", tp=tp, dp=dp, max_ctx=32)
            layers = eng.weights["layers"]["global"]
            res[f"tp{tp}dp{dp}"] = {
                "err": float(np.abs(eng.logits(ids) - ref).max()),
                "q": spec_of(layers["q"]), "k": spec_of(layers["k"]), "down": spec_of(layers["down"]),
                "cache": list(eng.new_cache(2, 8)["global"]["k"].sharding.spec),
            }
        out[name] = res
    # the int8 path shards the same way and decodes the same greedy tokens under TP=4
    path = os.path.join(tmp, "qwen3")
    prompts = [[1, 2, 3, 4], [5, 6]]
    one = jaxllm.load(path, dtype="float32", tp=1, max_ctx=32).generate_ids(prompts, max_tokens=6)
    four = jaxllm.load(path, dtype="float32", tp=4, max_ctx=32).generate_ids(prompts, max_tokens=6)
    out["greedy_int8"] = {"tp1": [c.token_ids for c in one], "tp4": [c.token_ids for c in four]}
    try:
        jaxllm.load(path, tp=3)
        out["tp3_error"] = None
    except jaxllm.ModelError as e:
        out["tp3_error"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
