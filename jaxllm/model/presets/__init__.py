"""Shape presets: the config.json of real checkpoints, shipped in the package, so that a named
architecture (`gemma4-31b`, `qwen3-4b`, ...) or any config.json path can be built with random
weights on a machine that has no checkpoint (`jaxllm.load(shape=...)`): benchmarks,
memory planning, compile checks."""

from __future__ import annotations

import json
from pathlib import Path

from jaxllm.config.model import ModelConfig
from jaxllm.errors import ModelError

PRESET_DIR = Path(__file__).parent


def names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def read(name: str) -> dict:
    """The HF config dict of a preset name or of a JSON file path."""
    p = Path(name).expanduser()
    if name.endswith(".json") or p.is_file():
        if not p.is_file():
            raise ModelError(f"--shape {name}: no such file")
    else:
        p = PRESET_DIR / f"{name}.json"
        if not p.is_file():
            raise ModelError(f"unknown shape {name!r} (known: {', '.join(names())}; or give a config.json path)")
    try:
        hf = json.loads(p.read_text())
    except ValueError as e:
        raise ModelError(f"{p}: malformed JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ModelError(f"{p}: not a config object")
    return hf


def preset_hf_config(name: str, **overrides) -> dict:
    """The config dict with `overrides` applied (e.g. fewer layers for a test; `layer_types` is cut
    to a smaller `num_hidden_layers`)."""
    hf = read(name)
    n = overrides.get("num_hidden_layers")
    if n is not None and hf.get("layer_types") and "layer_types" not in overrides:
        hf["layer_types"] = hf["layer_types"][:n]
    hf.update(overrides)
    return hf


def load_preset(name: str, **overrides) -> tuple[ModelConfig, object]:
    """-> (ModelConfig, family module) of a preset name or a config.json path."""
    from jaxllm.model.families import family_for  # JAX: `read` checks a name before it loads

    hf = preset_hf_config(name, **overrides)
    try:
        fam = family_for(hf)
        return fam.config_from_hf(hf, {}), fam
    except ModelError as e:
        raise ModelError(f"shape {name!r}: {e}") from None
