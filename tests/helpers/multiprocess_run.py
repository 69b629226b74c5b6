"""One process of a multi-process CPU run: `python multiprocess_run.py MODEL ADDR N ID`.
Joins through jaxllm.distributed, shards the model over both processes' devices (TP=2 across
processes), and process 0 prints the greedy tokens as JSON."""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

from jaxllm.cli import distributed


def main(model, addr, n, pid):
    assert distributed.initialize(addr, int(n), int(pid))
    import jax

    import jaxllm
    eng = jaxllm.load(model, dtype="float32", tp=2, max_ctx=32)
    assert jax.process_count() == 2 and len(eng.layout.mesh.devices.flat) == 2
    q = eng.weights["layers"]["global"]["q"].q
    local = [s.data.shape for s in q.addressable_shards]      # only this process's half was loaded
    out = eng.generate_ids([[1, 2, 3, 4], [5, 6]], max_tokens=6)
    distributed.main_print(json.dumps({"tokens": [c.token_ids for c in out], "local_q": local,
                                       "global_q": list(q.shape)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
