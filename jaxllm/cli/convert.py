"""`python -m jaxllm.convert --model-dir SRC --out DST [--quant int8|fp8|none] [--dtype ...]`

Converts a checkpoint (HF directory, .gguf file, or the embedded default) once into a saved jaxllm
directory: the weights already in the engine's layout and format, as an orbax checkpoint, beside
config.json and the tokenizer. `jaxllm.load(DST)` / `--model-dir DST` then restores them directly
into device shards. Nothing is written into SRC.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from jaxllm.config.engine import DTYPES, QUANTS, Parser, add_flags, from_args, settle
from jaxllm.errors import JaxllmError, ModelError
from jaxllm.weights import locate


def check(model_dir, out, quant: str, dtype: str):
    """-> (the model's files, the new directory): refused before JAX loads where they cannot be."""
    if quant not in QUANTS:
        raise ModelError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    dst = Path(out).expanduser()
    files = locate(model_dir)
    if dst.exists() and not dst.is_dir():
        raise ModelError(f"{dst} is a file; choose a new --out directory")
    if dst.exists() and any(dst.iterdir()):
        raise ModelError(f"{dst} exists and is not empty; choose a new --out directory")
    if isinstance(files.path, Path) and files.path.resolve() == dst.resolve():
        raise ModelError("--out must differ from --model-dir (nothing is written into the model directory)")
    return files, dst


def convert(model_dir, out, quant: str = "int8", dtype: str = "bfloat16", progress=None, tp=None) -> Path:
    """Write the saved directory `out`; the layout used while converting does not bind later loads
    (a restore reshards to whatever mesh it is given)."""
    files, dst = check(model_dir, out, quant, dtype)
    from jaxllm.engine import engine
    from jaxllm.model.sharding import layout_for
    from jaxllm.weights.loader import load_model
    from jaxllm.weights.saved import save_weights, write_source_files

    cfg, fam, weights, tok, _ = load_model(model_dir, engine.DTYPES[dtype], quant, progress, layout_for(tp))
    dst.mkdir(parents=True, exist_ok=True)
    write_source_files(files, dst, tok)
    save_weights(dst, weights, {"family": cfg.family, "quant": quant, "dtype": dtype, "source": str(files.name)})
    return dst


def main(argv=None) -> int:
    p = Parser(prog="python -m jaxllm.convert", description=__doc__.split("\n\n")[0])
    add_flags(p, ("out", "model_dir", "quant", "dtype", "tp"))
    args = p.parse_args(argv)
    if args.out is None:
        p.error("--out names the new directory to write")
    try:
        settle(args, from_args(args))
        t = time.perf_counter()
        dst = convert(args.model_dir, args.out, args.quant, args.dtype, tp=args.tp)
        print(f"wrote {dst} ({args.quant}, {args.dtype}) in {time.perf_counter() - t:.1f} s")
    except JaxllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
