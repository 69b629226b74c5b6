"""Shape presets: the config.json of real checkpoints, shipped in the package, so that a named
architecture (`gemma4-31b`, `qwen3-4b`, ...) can be built with random weights on a machine that
has no checkpoint: benchmarks, memory planning, compile checks."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..errors import ModelError
from ..models import family_for
from ..params import ParamSpec, is_spec
from ..loading.weights import is_quantized
from ..quant import QuantArray

PRESET_DIR = Path(__file__).parent


def names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def preset_hf_config(name: str, **overrides) -> dict:
    """The preset's config.json as a dict, with `overrides` applied (e.g. fewer layers for a test;
    `layer_types` is cut to a smaller `num_hidden_layers`)."""
    path = PRESET_DIR / f"{name}.json"
    if not path.exists():
        raise ModelError(f"unknown shape {name!r} (known: {', '.join(names())})")
    hf = json.loads(path.read_text())
    n = overrides.get("num_hidden_layers")
    if n is not None and hf.get("layer_types") and "layer_types" not in overrides:
        hf["layer_types"] = hf["layer_types"][:n]
    hf.update(overrides)
    return hf


def load_preset(name: str, **overrides) -> tuple[ModelConfig, object]:
    """-> (ModelConfig, family module) of a named real architecture."""
    hf = preset_hf_config(name, **overrides)
    fam = family_for(hf)
    return fam.config_from_hf(hf, {}), fam


def _random_leaf(spec: ParamSpec, key, dtype, quant: str):
    """A weight of the described shape made on the device (no host copy of a 30B-parameter model):
    matmul weights with std 1/sqrt(fan_in), as int8 values plus scales under quant='int8' (and the
    token embedding, with a scale per row, as the checkpoint loader quantizes it)."""
    if spec.init in ("ones", "zeros"):
        return (jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, dtype)
    lead = (1 if spec.axes[0] == "layers" else 0) + spec.n_batch
    n = max(spec.n_contract, 1)
    fan_in = int(np.prod(spec.shape[lead:lead + n]))
    if is_quantized(spec, quant):     # matmul weights, and the token embedding as the loader does
        q = jnp.maximum(jax.lax.bitcast_convert_type(jax.random.bits(key, spec.shape, jnp.uint8), jnp.int8), -127)
        scale_shape = spec.shape[:lead] + spec.shape[lead + n:] if spec.n_contract else spec.shape[:1] + (1,)
        # uniform integers in [-127, 127] have std about 127/sqrt(3)
        scale = jnp.full(scale_shape, np.sqrt(3.0) / (127.0 * np.sqrt(fan_in)), jnp.float32)
        return QuantArray(q, scale, spec.n_contract)
    # drawn in the target dtype: a float32 temporary of the largest stack would not fit beside the model
    return jax.random.normal(key, spec.shape, dtype) * jnp.asarray(1.0 / np.sqrt(fan_in), dtype)


def random_weights(cfg: ModelConfig, family, dtype=jnp.bfloat16, quant: str = "int8", seed: int = 0) -> dict:
    leaves, treedef = jax.tree_util.tree_flatten(family.abstract(cfg), is_leaf=is_spec)

    @jax.jit            # one compile for the whole tree, rather than one per distinct leaf shape
    def make(key):
        keys = jax.random.split(key, len(leaves))
        return [_random_leaf(s, k, dtype, quant) for s, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, make(jax.random.PRNGKey(seed)))


def random_engine(name: str, *, dtype: str = "bfloat16", quant: str = "int8", max_ctx: int = 4096,
                  seed: int = 0, **overrides):
    """An Engine of the named architecture with random weights and no tokenizer (token ids only)."""
    from ..engine import DTYPES, Engine
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if quant not in ("int8", "none"):
        raise ModelError(f"quant must be 'int8' or 'none', got {quant!r}")
    cfg, fam = load_preset(name, **overrides)
    weights = random_weights(cfg, fam, DTYPES[dtype], quant, seed)
    return Engine(cfg, weights, None, dtype=dtype, max_ctx=max_ctx, name=f"{name} (random weights)", quant=quant)
