"""jaxllm: a pure-JAX LLM inference engine for Gemma 4, Gemma 3 and Qwen3.

Importing the package loads no JAX: `Engine` and `Completion` are read from the engine when first
asked for, and `load` imports what it runs; the command-line front ends check their flags before
JAX loads."""
from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

from jaxllm.config.runtime import RuntimeConfig
from jaxllm.errors import JaxllmError, ModelError, RequestError
from jaxllm.kv.options import KVOptions

if TYPE_CHECKING:
    from jaxllm.engine.engine import Completion, Engine

__all__ = ["load", "Engine", "Completion", "KVOptions", "RuntimeConfig", "JaxllmError", "ModelError", "RequestError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("Engine", "Completion"):
        from jaxllm.engine import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")


def load(model_dir=None, max_ctx=8192, quant="int8", kv_quant="auto", tp=None, dtype="bfloat16",
         progress=None, dp=1, kv_options=None, speculative=None, num_speculative_tokens=4,
         draft_model_dir=None, speculative_max_batch=4, runtime=None, compilation_cache=None) -> Engine:
    """Load a model (HF directory, .gguf file, saved jaxllm checkpoint, hub id, or the embedded
    default when None), sharded over `tp` devices ("model" axis; None = every device) times `dp`
    ("data" axis, splitting the batch).

    dtype ("bfloat16", "float32") and quant ("int8", "none"): the compute dtype and the weights'
    format on the device. bfloat16 with int8 weights is the fastest of the four on GPUs and on a
    CPU alike (`scripts/cpu_peers.py`).

    kv_quant: "auto" keeps KV in the compute dtype up to `kv_options.threshold` (32768) positions and
    global layers' KV in int8 above it; "int8" always keeps them in int8; "none" never quantizes KV.
    Sliding layers hold only their window's KV blocks in every case.

    speculative: None, "ngram" (drafts looked up in the sequence itself) or "draft" (drafts from the
    model at `draft_model_dir`, which must share the tokenizer); `num_speculative_tokens` a cycle;
    cycles with more than `speculative_max_batch` live rows decode plainly (None: no limit).

    runtime: a `RuntimeConfig` (the backend's kernels, the layer scan, ...); None reads it from the
    environment (`RuntimeConfig.from_env`).

    compilation_cache: the folder of the persistent compilation cache, "off", or None for
    `$JAXLLM_COMPILATION_CACHE`, else `~/.cache/jaxllm/xla`: the programs that load the weights
    and the engine's compiled calls are kept there, and a later process reads them back
    (`jaxllm.engine.compilation_cache`).
    """
    from jaxllm.engine.engine import DTYPES, Engine
    from jaxllm.engine.sharding import layout_for
    from jaxllm.kv.options import KV_QUANT_MODES
    from jaxllm.weights import load_model
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if quant not in ("int8", "none"):
        raise ModelError(f"quant must be 'int8' or 'none', got {quant!r}")
    if kv_quant not in KV_QUANT_MODES:
        raise ModelError(f"kv_quant must be one of {', '.join(KV_QUANT_MODES)}, got {kv_quant!r}")
    if max_ctx is not None and (not isinstance(max_ctx, numbers.Integral) or max_ctx < 2):
        raise ModelError(f"max_ctx must be an integer of at least 2, got {max_ctx!r}")
    from jaxllm.engine.speculative import Speculation, check_args
    check_args(speculative, num_speculative_tokens, draft_model_dir)     # before any weight is read
    from jaxllm.engine.compilation_cache import enable
    enable(compilation_cache)        # before the weights' conversions compile (the engine keeps its calls there)
    layout = layout_for(tp, dp)
    cfg, fam, weights, tok, name = load_model(model_dir, DTYPES[dtype], quant, progress, layout)
    from jaxllm import ops
    runtime = RuntimeConfig.from_env() if runtime is None else runtime
    prepare = ops.select(runtime, layout).prepare_weights
    weights = prepare(weights, donate=True)      # the loader's arrays: ours to consume
    if max_ctx is None:
        max_ctx = cfg.default_ctx
    spec, draft = None, None
    if speculative == "draft":
        dcfg, _, draft, _, _ = load_model(draft_model_dir, DTYPES[dtype], quant, None, layout)
        draft = prepare(draft, donate=True)
        spec = Speculation("draft", num_speculative_tokens, draft_cfg=dcfg, max_batch=speculative_max_batch)
    elif speculative is not None:
        spec = Speculation(speculative, num_speculative_tokens, max_batch=speculative_max_batch)
    return Engine(cfg, weights, tok, dtype=dtype, max_ctx=int(max_ctx), name=name, quant=quant,
                  layout=layout, kv_quant=kv_quant, kv_options=kv_options, speculation=spec,
                  draft_weights=draft, runtime=runtime, compilation_cache=compilation_cache)
