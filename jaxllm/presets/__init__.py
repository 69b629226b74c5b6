"""Shape presets: the config.json of real checkpoints, shipped in the package, so that a named
architecture (`gemma4-31b`, `qwen3-4b`, ...) can be built with random weights on a machine that
has no checkpoint (`harness.synthetic.random_engine`): benchmarks, memory planning, compile checks."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ModelConfig
from ..errors import ModelError
from ..models import family_for

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
