"""The kernels against the XLA path on a real model, on this machine's GPU: greedy continuations,
the decode-step logits, and the logits of a 600-token prompt in one forward (the prefill kernel),
once with the XLA backend and once with the kernels, in float32 (matmuls at full float32
precision on both paths) and in bf16 with int8 weights (the serving configuration).

    python scripts/kernel_parity.py [--model-dir PATH] [--out DIR]    # default: the embedded model

Kernel tolerance, float32: decode-step and prefill logits within 1e-4 of the largest logit; greedy
tokens equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm import ops  # noqa: E402
from jaxllm.benchmarks.records import git_commit  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
TOL = 1e-4


def run(model_dir, mode: str, quant: str, dtype: str, long_ids, n_new: int, steps: int):
    eng = jaxllm.load(model_dir, quant=quant, dtype=dtype, max_ctx=2048, runtime=jaxllm.RuntimeConfig(kernels=mode))
    outs = eng.generate(PROMPTS, max_tokens=n_new, chat=False)
    ids = [eng.encode_prompt(p, chat=False) for p in PROMPTS]
    long_out = eng.generate_ids([long_ids], max_tokens=n_new)[0].token_ids
    seq = np.asarray([long_ids[:steps]], np.int32)  # step through past the 512 window
    stepper, logits = eng.core(1, steps + 8), []
    for t in range(seq.shape[1]):
        lg = stepper.step_logits(seq[:, t], np.full(1, t))
        if t % 50 == 49 or t == seq.shape[1] - 1:
            logits.append(np.asarray(lg, np.float32))
    prefill = np.asarray(eng.logits(seq), np.float32)[0]  # every position of one forward
    return {
        "tokens": [o.token_ids for o in outs] + [long_out],
        "logits": np.stack(logits),
        "prefill_logits": prefill,
        "prompt_ids": ids,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default=None)
    p.add_argument("--out", default="kernel_parity")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=600, help="decode steps whose logits are compared")
    p.add_argument(
        "--kernel-mode",
        default=None,
        help="the kernels setting for the kernel side (default: auto on a GPU, pallas elsewhere)",
    )
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 XLA dots, not TF32
    text = (
        open("/usr/share/common-licenses/GPL-3").read()
        if os.path.exists("/usr/share/common-licenses/GPL-3")
        else " ".join(["the quick brown fox jumps over the lazy dog"] * 150)
    )
    probe = jaxllm.load(a.model_dir, quant="none", dtype="float32", max_ctx=2048)
    long_ids = probe.tokenizer.encode(text)[:700]
    del probe
    report = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tolerance": TOL,
        "configs": [],
    }
    for quant, dtype in (("none", "float32"), ("int8", "bfloat16")):
        ref = run(a.model_dir, "xla", quant, dtype, long_ids, a.new_tokens, a.steps)
        mode = a.kernel_mode or ("auto" if jax.default_backend() == "gpu" else "pallas")
        got = run(a.model_dir, mode, quant, dtype, long_ids, a.new_tokens, a.steps)
        err = float(np.max(np.abs(got["logits"] - ref["logits"])) / np.max(np.abs(ref["logits"])))
        perr = float(
            np.max(np.abs(got["prefill_logits"] - ref["prefill_logits"])) / np.max(np.abs(ref["prefill_logits"]))
        )
        same = [g == r for g, r in zip(got["tokens"], ref["tokens"])]
        first_diff = [
            next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), None)
            for g, r in zip(got["tokens"], ref["tokens"])
        ]
        row = {
            "quant": quant,
            "dtype": dtype,
            "logit_rel_err": err,
            "prefill_logit_rel_err": perr,
            "greedy_equal": same,
            "first_difference": first_diff,
            "kernels_used": ops.selections()[-8:],
        }
        report["configs"].append(row)
        print(
            f"{quant:5s} {dtype:9s} step-logit error {err:.2e}, prefill-logit error {perr:.2e} "
            f"(of the largest logit); greedy "
            f"sequences equal {sum(same)}/{len(same)}; first differences {first_diff}",
            flush=True,
        )
    json.dump(report, open(os.path.join(a.out, "kernel_parity.json"), "w"), indent=1)
    f32 = report["configs"][0]
    ok = max(f32["logit_rel_err"], f32["prefill_logit_rel_err"]) <= TOL and all(f32["greedy_equal"])
    print("float32: " + ("within tolerance, greedy outputs identical" if ok else "OUT OF TOLERANCE"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
