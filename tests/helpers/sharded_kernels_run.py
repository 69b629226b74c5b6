"""Run in a subprocess with 4 host devices: the decode kernels forced on (Pallas interpret mode)
under TP=4, against the XLA path on one device: full-forward logits, decode-step logits and greedy
tokens of tiny checkpoints whose KV heads split over the 4 devices, or are fewer and replicated.
Prints one JSON object."""
import json
import os
import sys

# the suite's XLA flags (tests/conftest.py) come with the environment; 4 host devices on top
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import gemma4_refs  # noqa: E402
import numpy as np  # noqa: E402
from tp_models import make  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.ops import gpu as kernels

CASES = [      # name, checkpoint writer, (weight format, KV format, k_eq_v layers store keys)
    ("qwen3-kv4", lambda p: make("qwen3", p, num_key_value_heads=4), (("none", "none", True),)),  # int8: Gemma 4
    ("qwen3-kv2", lambda p: make("qwen3", p, num_key_value_heads=2), (("none", "none", True),)),  # XLA attention
    # 1 global KV head (replicated); with int8 KV, keys rebuilt from the int8 global values
    # (stored int8 keys read as any int8 pool: the kernel tests)
    ("gemma4-31b", lambda p: gemma4_refs.build("31b").save_pretrained(p),
     (("int8", "none", True), ("int8", "int8", False))),
]


def run(path, tp, mode, quant, kv, store_keys):
    # every step traced here (no compiled steps read back), so that the kernels it chose are recorded
    eng = jaxllm.load(path, dtype="float32", quant=quant, tp=tp, max_ctx=32, kv_quant=kv,
                      kv_options=jaxllm.KVOptions(store_keys=store_keys),
                      runtime=jaxllm.RuntimeConfig(kernels=mode), compilation_cache="off")
    assert eng.ops.name == mode, (eng.ops, mode)
    ids = np.random.default_rng(0).integers(0, 160, (2, 9)).astype(np.int32)
    full = eng.logits(ids)
    stepper, steps = eng.core(2, 16), []
    for t in range(ids.shape[1]):
        lg = stepper.step_logits(ids[:, t], np.full(2, t))
        steps.append(np.asarray(lg))
    greedy = [c.token_ids for c in eng.generate_ids([[1, 2, 3, 4], [5, 6]], max_tokens=6)]
    return full, np.stack(steps), greedy


def main(tmp):
    out = {}
    for name, write, quants in CASES:
        path = os.path.join(tmp, name)
        write(path)
        for quant, kv, store_keys in quants:
            ref = run(path, 1, "xla", quant, kv, store_keys)
            got = run(path, 4, "pallas", quant, kv, store_keys)
            scale = float(np.abs(ref[0]).max())
            out[f"{name}-{quant}-kv{kv}" + ("" if store_keys else "-rebuilt")] = {
                "forward_err": float(np.abs(got[0] - ref[0]).max()) / scale,
                "step_err": float(np.abs(got[1] - ref[1]).max()) / scale,
                "greedy_equal": got[2] == ref[2],
            }
    out["selections"] = kernels.selections()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
