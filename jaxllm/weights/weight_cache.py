"""A per-user cache of the models built from GGUF files.

Building a GGUF model -- dequantizing every block with the gguf package, casting or quantizing the
result, and rebuilding the tokenizer from the file's vocabulary -- is most of its load time (about
10 s for the embedded 270M model on two CPU cores). After the first load of a GGUF source, the
loaded model is written in the saved-checkpoint format of `jaxllm.convert` (config.json, tokenizer
files and the orbax weights; see `saved`) to

    Caches.folder / "weights" / "<sha256[:32]>-<quant>-<dtype>-v<FORMAT>-<code>"

and a later load of the same source with the same quant and dtype restores that directory; the
GGUF file itself is not read then. The layout is not part of the key, since a restore reshards to
whatever layout it is given.

- sha256 names the source's content. For the embedded model it is the digest its package
  publishes, so a hit neither reads nor hashes its parts. Any other file is hashed once, and the
  digest kept in `weights/digests/` under a name made of the file's resolved path, size, mtime_ns
  and ctime_ns: a file changed in any way is hashed again.
- code is a short hash of the source of the modules that turn GGUF bytes into the saved model, so
  an entry is never read by code that would have built something else; FORMAT is bumped when what
  an entry holds changes in a way those sources do not show.

An entry is written into a hidden temporary directory beside its final name and then renamed, so
the final name only ever holds a complete entry, however its writer ends. An entry that cannot be
read back is deleted and rebuilt, with one warning; a cache that cannot be written costs one
warning. `Caches.weights` off (`JAXLLM_WEIGHT_CACHE=off` at a front end, or
`jaxllm.load(weight_cache=False)`) turns the cache off.
It is never used in a multi-process run, where every process must take the same path through a load.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxllm.config.runtime import Caches
from jaxllm.errors import ModelError
from jaxllm.model.sharding import check_divisible, single_device_layout
from jaxllm.weights import saved
from jaxllm.weights.default import DEFAULT_MODEL_NAME, default_model_digest
from jaxllm.weights.files import read_dir

FORMAT = 1
# What decides the bytes of an entry: dequantization, conversion, quantization, the saved format
# and the config/tokenizer files; plus every family module (jaxllm/models/*.py).
CODE_MODULES = (
    "jaxllm.weights.gguf",
    "jaxllm.weights.gguf_archs",
    "jaxllm.weights.gguf_file",
    "jaxllm.weights.gguf_tokenizer",
    "jaxllm.weights.place",
    "jaxllm.weights.saved",
    "jaxllm.weights.weights",
    "jaxllm.model.params",
    "jaxllm.quant",
)
STALE_TMP_S = 24 * 3600  # a temporary directory this old belongs to a writer that died
HEADROOM = 1 << 30  # free space an entry must leave on its disk


@dataclass(frozen=True)
class Entry:
    path: Path  # the entry's directory, present or not
    name: str  # display name of the model
    digest: str
    quant: str
    dtype: str


def entry_for(model_dir, quant: str, dtype, caches: Caches) -> Entry | None:
    """The cache entry of a GGUF source (the embedded default or a .gguf file) under
    `caches.folder`; None for any other source, when the cache is off, or in a multi-process run
    (where every process must take the same path through a load)."""

    if not (caches.weights and caches.folder is not None) or jax.process_count() != 1:
        return None
    source = _source(model_dir, caches.folder)
    if source is None:
        return None
    name, digest = source
    dtype = jnp.dtype(dtype).name
    path = caches.folder / "weights" / f"{_stem(digest, quant, dtype)}-v{FORMAT}-{code_fingerprint()}"
    return Entry(path, name, digest, quant, dtype)


def _stem(digest: str, quant: str, dtype: str) -> str:
    return f"{digest[:32]}-{quant}-{dtype}"  # the full digest is in the entry's jaxllm.json


def _source(model_dir, folder: Path) -> tuple[str, str] | None:
    """(display name, sha256) of a GGUF source, or None (not one, or unreadable: the load that
    follows reports why)."""
    if model_dir is None:
        digest = default_model_digest()
        return None if digest is None else (DEFAULT_MODEL_NAME, digest)
    p = Path(model_dir).expanduser()
    if not (p.is_file() and p.suffix == ".gguf"):
        return None
    digest = file_digest(p, folder)
    return None if digest is None else (p.name, digest)


def code_fingerprint() -> str:
    h = hashlib.sha256()
    for name in CODE_MODULES:
        h.update(Path(importlib.util.find_spec(name).origin).read_bytes())
    for p in sorted(Path(importlib.util.find_spec("jaxllm.model.families").origin).parent.glob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


# ------------------------------------------------------------------------------------------------
# Digests of GGUF files
# ------------------------------------------------------------------------------------------------


def file_digest(p: Path, folder: Path) -> str | None:
    """The sha256 of `p`, read from its memo under `folder` when the file has not changed since;
    None when the file cannot be read or changes while it is hashed."""
    try:
        version = _version(p)
        memo = folder / "weights" / "digests" / version
        known = _read_memo(memo)
        if known:
            return known
        digest = _sha256(p)
        if _version(p) != version:
            return None
    except OSError:
        return None
    _write_memo(memo, digest)
    return digest


def _version(p: Path) -> str:
    """A name for this version of the file (reading it changes its atime, so that is left out)."""
    st = p.stat()
    key = f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _read_memo(memo: Path) -> str | None:
    try:
        text = memo.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def _write_memo(memo: Path, digest: str) -> None:
    """Best effort and silent: without a memo the file is only hashed again (a cache that cannot
    be written is reported once, when the entry is written)."""
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(digest + "\n")
        os.replace(tmp, memo)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


# ------------------------------------------------------------------------------------------------
# Entries
# ------------------------------------------------------------------------------------------------


def read(entry: Entry, dtype, layout):
    """(config, family, weights, tokenizer) from the entry, or None when there is none. A damaged
    entry is deleted, with one warning, and None returned, so that the caller builds it again."""

    if not entry.path.is_dir():
        return None
    layout = layout or single_device_layout()
    try:
        _check_meta(entry, saved.read_meta(entry.path))
        cfg, family, tok = read_dir(entry.path)
    except Exception as e:  # damage surfaces as anything from json to tokenizers errors
        return _damaged(entry, e)
    check_divisible(layout, family.abstract(cfg))  # a split the model cannot take is the caller's error
    try:
        weights = saved.restore_weights(entry.path, cfg, family, entry.quant, dtype, layout)
    except Exception as e:
        return _damaged(entry, e)
    return cfg, family, weights, tok


def _damaged(entry: Entry, e: Exception) -> None:
    reason = _one_line(e).replace(f"{entry.path}{os.sep}", "")
    warnings.warn(
        f"weight cache entry {entry.path} is damaged ({reason}); building it again from the GGUF file", stacklevel=4
    )
    _remove(entry.path)


def _check_meta(entry: Entry, meta: dict) -> None:
    want = _meta(entry)
    got = {k: meta.get(k) for k in want}
    if got != want:
        raise ModelError(f"jaxllm.json describes other weights ({got} instead of {want})")


def _meta(entry: Entry) -> dict:
    return {"quant": entry.quant, "dtype": entry.dtype, "source_sha256": entry.digest, "cache_format": FORMAT}


def write(entry: Entry, files, cfg, weights, tok) -> None:
    """Save the model just built from `files` as the entry. Never fails the load: a cache that
    cannot be written is one warning."""

    root = entry.path.parent
    tmp = root / f".{entry.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _check_space(root, weights)
        tmp.mkdir()
        saved.write_source_files(files, tmp, tok)
        saved.save_weights(tmp, weights, {"family": cfg.family, "source": files.name, **_meta(entry)}, compress=False)
        _publish(tmp, entry.path)
    except Exception as e:  # orbax and tensorstore raise their own types for a full disk
        warnings.warn(
            f"could not write the weight cache in {root} ({_one_line(e)}); the next load of "
            f"{entry.name} will build its weights again (set JAXLLM_CACHE elsewhere, or "
            "JAXLLM_WEIGHT_CACHE=off)",
            stacklevel=3,
        )
        return
    finally:
        _remove(tmp)
    _prune(entry)


def _check_space(root: Path, weights) -> None:

    need = sum(x.nbytes for x in jax.tree_util.tree_leaves(weights))
    free = shutil.disk_usage(root).free
    if free < need + HEADROOM:
        raise OSError(
            f"{free / 2**30:.1f} GiB free, the weights need {need / 2**30:.1f} GiB and "
            f"{HEADROOM / 2**30:.0f} GiB is kept free"
        )


def _publish(tmp: Path, final: Path) -> None:
    """Rename the written entry into place. A concurrent writer that got there first leaves an
    equally good entry, so ours is dropped."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise


def _prune(entry: Entry) -> None:
    """Remove what earlier code left for the same weights (other code or format versions), and
    temporary directories of writers that died."""
    root = entry.path.parent
    for old in root.glob(f"{_stem(entry.digest, entry.quant, entry.dtype)}-v*"):
        if old != entry.path:
            _remove(old)
    now = time.time()
    for tmp in root.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                _remove(tmp)
        except OSError:
            pass


def _remove(d: Path) -> None:
    """Take `d` away from its name first, so no reader sees it half deleted."""
    gone = d.with_name(f".{d.name}.{uuid.uuid4().hex[:8]}.deleted.tmp")
    try:
        os.rename(d, gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text[:300] if text else type(e).__name__
