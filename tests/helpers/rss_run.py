"""Peak host memory while loading a checkpoint: `python rss_run.py MODEL_DIR QUANT`.
Prints JSON: peak RSS growth during the load, and the checkpoint's and loaded weights' sizes."""
import json
import os
import resource
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def rss_mb(kind="peak"):
    """Peak (VmHWM) or current (VmRSS) resident memory. Not getrusage's ru_maxrss: Linux carries
    that over exec from the parent, so under a test runner it reports the runner's size."""
    key = "VmHWM" if kind == "peak" else "VmRSS"
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(model, quant):
    import jaxllm
    from jaxllm.weights.place import _setter, _zeros
    jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()      # runtime up before the baseline
    base = rss_mb("now")
    t = time.perf_counter()
    eng = jaxllm.load(model, quant=quant, max_ctx=64)
    load_s = time.perf_counter() - t
    peak = rss_mb("peak")
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(eng.weights))
    ckpt = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
    print(json.dumps({"baseline_mb": base, "peak_mb": peak, "growth_mb": peak - base,
                      "checkpoint_mb": ckpt / 2**20, "weights_mb": weights / 2**20, "load_s": load_s,
                      "compiled_helpers": _zeros.cache_info().currsize + _setter.cache_info().currsize}))


if __name__ == "__main__":
    main(*sys.argv[1:])
