"""Saved jaxllm checkpoints: the converted (e.g. int8) weight pytree as an orbax checkpoint, next to
the source's config.json and tokenizer files, so a later load restores straight into device shards
without reading, transposing and quantizing the original checkpoint again.

Layout of a saved directory:
    config.json, tokenizer files     as in a Hugging Face directory
    jaxllm.json                      {"format": "jaxllm", "version", "family", "quant", "dtype",
                                      "files": the size of every file under weights/}
    weights/                         orbax checkpoint of the weights (QuantArray as {"q", "scale"})
"""

from __future__ import annotations

import gc
import inspect
import json
import shutil
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxllm.errors import ModelError
from jaxllm.model.params import map_specs
from jaxllm.model.sharding import check_divisible, scale_shape_axes, single_device_layout
from jaxllm.quant import VALUE_DTYPES, QuantArray
from jaxllm.weights.files import SAVED_META as META
from jaxllm.weights.files import read_dir
from jaxllm.weights.weights import weight_format

WEIGHTS = "weights"
VERSION = 1


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
    return jax.tree_util.tree_map(
        lambda x: {"q": x.q, "scale": x.scale} if isinstance(x, QuantArray) else x,
        tree,
        is_leaf=lambda x: isinstance(x, QuantArray),
    )


def save_weights(d: Path, weights, meta: dict, compress: bool = True) -> None:
    """compress: zstd on every array. Off, the directory is ~20% larger and restores ~3x faster
    (decoding was most of a restore of int8 weights, which hardly compress)."""

    import orbax.checkpoint as ocp  # orbax (and the Pallas it loads) only where a checkpoint is read or written

    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=compress)) as ckpt:
        ckpt.save((d / WEIGHTS).absolute(), to_plain(weights))
    files = {
        p.relative_to(d / WEIGHTS).as_posix(): p.stat().st_size for p in sorted((d / WEIGHTS).rglob("*")) if p.is_file()
    }
    (d / META).write_text(json.dumps({"format": "jaxllm", "version": VERSION, **meta, "files": files}, indent=1) + "\n")


def _check_files(d: Path, meta: dict) -> None:
    """Files of the checkpoint that are missing or cut short, found before orbax reads any (see
    _check_shapes). Directories saved before the sizes were recorded are not checked."""
    for name, size in meta.get("files", {}).items():
        try:
            got = (d / WEIGHTS / name).stat().st_size
        except OSError:
            got = None
        if got != size:
            what = "missing" if got is None else f"{got} bytes, not {size}"
            raise ModelError(f"{d / WEIGHTS}: unreadable or incomplete saved checkpoint ({name} is {what})")


def _check_shapes(stored, plain) -> None:
    """The stored shapes against those the config asks for, before any read starts: a restore
    that fails midway leaves reads behind, whose warnings can reach the user long after."""
    stored = getattr(stored, "item_metadata", stored)
    got = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(stored)}
    for k, want in jax.tree_util.tree_leaves_with_path(plain):
        key = jax.tree_util.keystr(k)
        if got.get(key) != tuple(want.shape):
            raise ModelError(f"it holds {got.get(key, 'nothing')} for {key}, the config asks for {tuple(want.shape)}")


def _late_read_after_failure(unraisable) -> bool:
    """A read of a failed restore finishing after orbax closed its event loop: tensorstore then
    posts its result to the closed loop, and that RuntimeError surfaces as an unraisable exception.
    Or a read that never finished: closing its coroutine throws GeneratorExit into orbax's
    `except BaseException`, which raises an Exception of its own from it."""
    e, tb = unraisable.exc_value, unraisable.exc_traceback
    if isinstance(e.__cause__, GeneratorExit) and inspect.iscoroutine(unraisable.object):
        return True
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (
        isinstance(e, RuntimeError)
        and str(e) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "_check_closed"
    )


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


def load_saved(d: Path, dtype, quant: str, layout=None):
    """(config, family, weights, tokenizer) of a saved directory."""

    cfg, family, tok = read_dir(d)
    weights = restore_weights(d, cfg, family, quant, dtype, layout or single_device_layout())
    return cfg, family, weights, tok


def restore_weights(d: Path, cfg, family, quant: str, dtype, layout):
    """The saved weights, restored directly into the shardings `layout` gives them."""

    meta = read_meta(d)
    if meta.get("quant") != quant:
        raise ModelError(
            f"{d} holds {meta.get('quant')} weights; load it with quant={meta.get('quant')!r} "
            f"(--quant {meta.get('quant')}) or convert the source again"
        )
    tree = family.abstract(cfg)
    check_divisible(layout, tree)

    def target(spec):
        fmt = weight_format(spec, quant)
        sh = layout.param_sharding(spec, fmt)
        if isinstance(sh, QuantArray):
            return {
                "q": jax.ShapeDtypeStruct(spec.shape, VALUE_DTYPES[fmt], sharding=sh.q),
                "scale": jax.ShapeDtypeStruct(scale_shape_axes(spec, sh.blockwise)[0], jnp.float32, sharding=sh.scale),
            }
        return jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sh)

    plain = map_specs(target, tree)
    path = (d / WEIGHTS).absolute()
    _check_files(d, meta)
    hook = _quiet_late_reads()
    with warnings.catch_warnings():
        # a failed restore drops the reads it had not started: their coroutines are never awaited
        warnings.filterwarnings("ignore", "coroutine '.*' was never awaited", RuntimeWarning)
        try:
            import orbax.checkpoint as ocp  # orbax (and the Pallas it loads) only where a checkpoint is read or written

            with ocp.StandardCheckpointer() as ckpt:
                _check_shapes(ckpt.metadata(path), plain)
                restored = ckpt.restore(path, plain)
            failure = None
        except Exception as e:  # orbax/tensorstore raise many types for a damaged directory
            failure = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if failure is not None:
            gc.collect()  # the dropped reads go now, while their warnings are ignored
    if failure is not None:
        raise ModelError(f"{d / WEIGHTS}: unreadable or incomplete saved checkpoint ({failure})")
    if getattr(sys.unraisablehook, "_jaxllm_late_reads", False):
        sys.unraisablehook = hook

    def rebuild(spec, x):
        if not isinstance(x, dict):
            return x
        return QuantArray(x["q"], x["scale"], spec.n_contract, weight_format(spec, quant) == "fp8")

    specs, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda s: hasattr(s, "n_contract"))
    return jax.tree_util.tree_unflatten(
        treedef, [rebuild(s, x) for s, x in zip(specs, treedef.flatten_up_to(restored))]
    )


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def write_source_files(files, dst: Path, tok) -> None:
    """config.json and tokenizer files: copied from an HF directory, written out for a GGUF file."""
    if files.kind == "hf":
        for name in ("config.json",) + TOKENIZER_FILES:
            if (files.path / name).exists():
                shutil.copy2(files.path / name, dst / name)
        if files.stored is not None:  # the saved weights are no longer in the checkpoint's format
            hf = json.loads((dst / "config.json").read_text())
            del hf["quantization_config"]
            (dst / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        return

    from jaxllm.weights.gguf import read_gguf_config  # the gguf package only where a GGUF file is read

    (dst / "config.json").write_text(json.dumps(read_gguf_config(files.path), indent=1, default=str))
    tok.tok.save(str(dst / "tokenizer.json"))
    # A template here marks the model chat-tuned when read back (`Tokenizer.from_hf_dir`), so a base
    # model's is left out: the family's fallback is supplied again.
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "add_bos_token": tok.add_bos,
                "chat_template": tok.chat_template if tok.chat_tuned else None,
            },
            indent=1,
        )
    )
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": list(tok.eos_ids)}))
