"""Saved jaxllm checkpoints: the converted (e.g. int8) weight pytree as an orbax checkpoint, next to
the source's config.json and tokenizer files, so a later load restores straight into device shards
without reading, transposing and quantizing the original checkpoint again.

Layout of a saved directory:
    config.json, tokenizer files     as in a Hugging Face directory
    jaxllm.json                      {"format": "jaxllm", "version", "family", "quant", "dtype"}
    weights/                         orbax checkpoint of the weights (QuantArray as {"q", "scale"})
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

from ..errors import ModelError
from ..params import map_specs
from ..quant import QuantArray

META = "jaxllm.json"
WEIGHTS = "weights"
VERSION = 1


def is_saved(d: Path) -> bool:
    return (d / META).exists()


def read_meta(d: Path) -> dict:
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{d / META}: unreadable ({e})") from None
    if meta.get("format") != "jaxllm" or meta.get("version") != VERSION:
        raise ModelError(f"{d / META}: not a version-{VERSION} jaxllm checkpoint")
    return meta


def to_plain(tree):
    """QuantArray leaves -> {"q", "scale"} dicts: the saved tree needs no custom pytree types."""
    return jax.tree_util.tree_map(lambda x: {"q": x.q, "scale": x.scale} if isinstance(x, QuantArray) else x,
                                  tree, is_leaf=lambda x: isinstance(x, QuantArray))


def save_weights(d: Path, weights, meta: dict) -> None:
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save((d / WEIGHTS).absolute(), to_plain(weights))
    (d / META).write_text(json.dumps({"format": "jaxllm", "version": VERSION, **meta}, indent=1) + "\n")


def _late_read_after_failure(unraisable) -> bool:
    """A read of a failed restore finishing after orbax closed its event loop: tensorstore then
    posts its result to the closed loop, and that RuntimeError surfaces as an unraisable exception."""
    e, tb = unraisable.exc_value, unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (isinstance(e, RuntimeError) and str(e) == "Event loop is closed" and tb is not None
            and tb.tb_frame.f_code.co_name == "_check_closed")


def _quiet_late_reads():
    """A failed restore is reported in one line, so the reads it left in flight must not print
    tracebacks when they finish, which can be before the failure reaches us (while orbax closes its
    loop) or long after. Every other unraisable exception still reaches the hook. Returns the hook
    to put back once a restore has succeeded (none of its reads is then left in flight)."""
    hook = sys.unraisablehook
    if getattr(hook, "_jaxllm_late_reads", False):
        return hook

    def quiet(unraisable):
        if not _late_read_after_failure(unraisable):
            hook(unraisable)
    quiet._jaxllm_late_reads = True
    sys.unraisablehook = quiet
    return hook


def restore_weights(d: Path, cfg, family, quant: str, dtype, layout):
    """The saved weights, restored directly into the shardings `layout` gives them."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from ..sharding import check_divisible, scale_shape_axes
    from .weights import is_quantized
    meta = read_meta(d)
    if meta.get("quant") != quant:
        raise ModelError(f"{d} holds {meta.get('quant')} weights; load it with quant={meta.get('quant')!r} "
                         f"(--quant {meta.get('quant')}) or convert the source again")
    tree = family.abstract(cfg)
    check_divisible(layout, tree)

    def target(spec):
        sh = layout.param_sharding(spec, is_quantized(spec, quant))
        if isinstance(sh, QuantArray):
            return {"q": jax.ShapeDtypeStruct(spec.shape, jnp.int8, sharding=sh.q),
                    "scale": jax.ShapeDtypeStruct(scale_shape_axes(spec)[0], jnp.float32, sharding=sh.scale)}
        return jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sh)

    plain = map_specs(target, tree)
    hook = _quiet_late_reads()
    try:
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore((d / WEIGHTS).absolute(), plain)
    except Exception as e:       # orbax/tensorstore raise many types for a damaged directory
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ModelError(f"{d / WEIGHTS}: unreadable or incomplete saved checkpoint ({first})") from None
    if getattr(sys.unraisablehook, "_jaxllm_late_reads", False):
        sys.unraisablehook = hook

    def rebuild(spec, x):
        return QuantArray(x["q"], x["scale"], spec.n_contract) if isinstance(x, dict) else x
    specs, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda s: hasattr(s, "n_contract"))
    return jax.tree_util.tree_unflatten(treedef, [rebuild(s, x) for s, x in
                                                  zip(specs, treedef.flatten_up_to(restored))])
