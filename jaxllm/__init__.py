"""jaxllm: a pure-JAX LLM inference engine for Gemma 4, Gemma 3 and Qwen3.

Importing the package loads no JAX: `Engine` and `Completion` are read from the engine when first
asked for, and `load` imports what it runs; the command-line front ends check their flags before
JAX loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxllm.config.engine import EngineConfig
from jaxllm.config.kv import KVOptions
from jaxllm.config.runtime import Caches, RuntimeConfig
from jaxllm.errors import JaxllmError, ModelError, RequestError

if TYPE_CHECKING:
    from jaxllm.engine.engine import Completion, Engine

__all__ = [
    "load",
    "Engine",
    "Completion",
    "EngineConfig",
    "KVOptions",
    "RuntimeConfig",
    "Caches",
    "JaxllmError",
    "ModelError",
    "RequestError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("Engine", "Completion"):
        from jaxllm.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")


def load(model_dir=None, *, config: EngineConfig | None = None, progress=None, **fields) -> Engine:
    """Build an engine: from `config` (an `EngineConfig`), or from `model_dir` (an HF directory,
    .gguf file, saved jaxllm checkpoint or hub id; None: the embedded default) and any other fields
    of `EngineConfig` as keywords (dtype, quant, kv_quant, max_ctx, tp, dp, kv_options,
    speculative, num_speculative_tokens, draft_model_dir, speculative_max_batch, shape, tokenizer,
    runtime, caches, ...; each one's meaning is in `EngineConfig`'s docstring).

    Every field is checked before any weight is read. Without `runtime`, the backend's choices
    come from the environment (`RuntimeConfig.from_env`), and without `caches` where things are
    kept (`Caches.from_env`, whose `compilation_cache` (a folder or "off") and `weight_cache` (on
    or off) may be given here), both read here once. `progress(n, total)` is called as the model's
    tensors load.
    """
    if config is None:
        if fields.get("runtime") is None:
            fields["runtime"] = RuntimeConfig.from_env()
        asked = {k: fields.pop(k) for k in ("compilation_cache", "weight_cache") if k in fields}
        if fields.get("caches") is None:
            fields["caches"] = Caches.from_env(**asked)
        elif asked:
            raise ModelError(f"give caches or {' and '.join(asked)}, not both")
        config = EngineConfig(model_dir=model_dir, **fields)
    elif model_dir is not None or fields:
        raise ModelError("jaxllm.load takes a config or its fields, not both")
    from jaxllm.engine.build import build_engine

    return build_engine(config, progress)
