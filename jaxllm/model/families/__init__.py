"""Model families. Each family file states only what differs: config mapping, tensor names, and the
few functions whose math differs. Detection reads config.json's model_type / architectures."""

from __future__ import annotations

from jaxllm.errors import ModelError
from jaxllm.model.families import gemma3, gemma4, qwen3

FAMILIES = (qwen3, gemma3, gemma4)


def family_for(hf: dict):
    mt = hf.get("model_type")
    for fam in FAMILIES:
        if mt in fam.MODEL_TYPES:
            return fam
    for arch in hf.get("architectures") or []:
        for fam in FAMILIES:
            if arch in fam.ARCHITECTURES:
                return fam
    supported = ", ".join(t for f in FAMILIES for t in f.MODEL_TYPES)
    what = mt or (hf.get("architectures") or ["<none>"])[0]
    raise ModelError(f"unsupported model architecture {what!r} (supported model_type: {supported})")


def family_named(name: str):
    """The family module whose name is `name` (a ModelConfig's `family`), or None."""
    return next((f for f in FAMILIES if f.__name__.rsplit(".", 1)[-1] == name), None)


def abstract(cfg) -> dict:
    """The weight description (`model.params`) of a model of config `cfg`, from its family."""
    return family_named(cfg.family).abstract(cfg)
