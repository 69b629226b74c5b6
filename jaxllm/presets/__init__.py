"""Architecture configs of real checkpoints (config.json of the text models, no weights), by name:
shapes for benchmarks and compile checks without downloading a model."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelError

HERE = Path(__file__).parent


def names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.json"))


def load_preset(name: str):
    """-> (ModelConfig, family module) of the named architecture, e.g. 'qwen3-32b'."""
    from ..models import family_for
    path = HERE / f"{name}.json"
    if not path.exists():
        raise ModelError(f"unknown shape {name!r} (known: {', '.join(names())})")
    hf = json.loads(path.read_text())
    fam = family_for(hf)
    return fam.config_from_hf(hf, {}), fam
