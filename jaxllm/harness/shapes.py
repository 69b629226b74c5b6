"""Named model shapes for benchmarking without weights: the config.json of a real architecture,
mapped through its family exactly as a checkpoint's would be."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ModelConfig
from ..errors import ModelError
from ..models import family_for

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def read_shape(name: str) -> dict:
    """The HF config dict of a preset name or of a JSON file path."""
    p = Path(name).expanduser()
    if name.endswith(".json") or p.is_file():
        if not p.is_file():
            raise ModelError(f"--shape {name}: no such file")
    else:
        p = PRESET_DIR / f"{name}.json"
        if not p.is_file():
            raise ModelError(f"unknown shape {name!r} (known: {', '.join(preset_names())}; or give a config.json path)")
    try:
        hf = json.loads(p.read_text())
    except ValueError as e:
        raise ModelError(f"{p}: malformed JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ModelError(f"{p}: not a config object")
    return hf


def resolve_shape(name: str, **overrides):
    """-> (ModelConfig, family module) for a preset name or a config.json path; `overrides` change
    config.json entries (e.g. fewer layers for a test)."""
    from ..presets import load_preset
    if (PRESET_DIR / f"{name}.json").is_file():
        try:
            return load_preset(name, **overrides)
        except ModelError as e:
            raise ModelError(f"shape {name!r}: {e}") from None
    hf = {**read_shape(name), **overrides}
    try:
        fam = family_for(hf)
        cfg: ModelConfig = fam.config_from_hf(hf)
    except ModelError as e:
        raise ModelError(f"shape {name!r}: {e}") from None
    return cfg, fam
