"""Compiled steps kept on disk, for the engines a front end builds (`Caches.compilation`, on by
default in `jaxllm.load` and every command line, which pass their `--compilation-cache` flag
through), in two layers:

- JAX's persistent compilation cache: a process that compiles a program another process compiled
  already (same program, same devices, same JAX) reads the executable instead of running XLA.
- The engine's own executables (`executables/` beside it): the core's prefill and decode calls,
  serialized whole, under a key of everything that shapes them (this package's source, JAX's
  version, the devices and mesh, the model's configuration and weight layout, the call's
  arguments, the runtime configuration, XLA's own environment). A hit skips tracing and lowering
  too, which for a model with Pallas kernels is most of a warm start. The key does not see a
  function patched inside a process, nor does a call read back record what its tracing would (the
  kernels chosen): a process that patches the code its steps trace, or reads those records (the
  test suite), sets `KEEP_STEPS` off or builds its engines without the cache.

The folder is `Caches.from_env`'s: `$JAXLLM_COMPILATION_CACHE`, else `$XDG_CACHE_HOME/jaxllm/xla`
(`~/.cache/jaxllm/xla`); `jaxllm.load(compilation_cache=DIR)` or `--compilation-cache DIR` moves
it and `off` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jaxlib
from jax.experimental.serialize_executable import deserialize_and_load, serialize

log = logging.getLogger("jaxllm")
MIN_COMPILE_SECONDS = 0.5  # compiles quicker than this are not worth a file
KEEP_STEPS = True  # whether engines keep and read back their executables (see above)


def enable(path: Path | None) -> Path | None:
    """Point JAX's persistent compilation cache at `path` (None: off); -> the folder, or None when
    off or when it cannot be created. Programs compiled before it is called are not kept."""
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache %s cannot be created (%s); compiling without it", path, e.strerror or e)
        return None

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def executables_folder(path: Path | None) -> Path | None:
    """Where an engine keeps its executables, for the folder `enable` returned (None: none kept)."""
    return None if path is None or not KEEP_STEPS else path / "executables"


@dataclass
class Compiles:
    """The programs an engine has made ready so far, by where each came from: its core's calls
    compiled in this process (`compiled`; of them, `from_jax_cache` answered by JAX's persistent
    cache, traced and lowered but not compiled), or read back whole from the compiled-steps cache
    (`read`); and its KV pools' allocators, one a pool shape (`allocators`)."""

    compiled: int = 0
    from_jax_cache: int = 0
    read: int = 0
    allocators: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def programs(self) -> int:
        """Every program the engine has: a run that needs no new one leaves it as it was."""
        return self.compiled + self.read + self.allocators

    def add(self, kind: str, n: int = 1) -> None:
        with self.lock:  # calls compile on threads of their own
            setattr(self, kind, getattr(self, kind) + n)


# -- the engine's executables ------------------------------------------------------------------------
PACKAGE = Path(__file__).resolve().parent.parent  # jaxllm/


def sources() -> list[Path]:
    """Every Python file of the package, whichever of its folders: the kernels a call runs are as
    much its program as the engine's own code."""
    return sorted(PACKAGE.rglob("*.py"))


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of every Python file of this package: a changed line is a different program."""
    h = hashlib.sha256()
    for f in sources():
        h.update(str(f.relative_to(PACKAGE)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def describe(tree) -> str:
    """A pytree's structure, and each leaf's shape, dtype and sharding."""

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        parts.append(f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{sharding}")
    return "|".join(parts)


def executable_key(*material) -> str:

    h = hashlib.sha256()
    for part in (
        source_digest(),
        jax.__version__,
        jaxlib.__version__,
        str(jax.config.read("jax_enable_x64")),
        *material,
    ):
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def load_executable(folder: Path | None, key: str):
    """The executable stored under `key` in `folder`, or None (none stored, off, or unreadable)."""
    if folder is None:
        return None
    path = folder / f"{key}.bin"
    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())

        return deserialize_and_load(payload, in_tree, out_tree)
    except FileNotFoundError:
        return None
    except Exception as e:  # damaged or from an incompatible runtime: compile anew
        log.warning("compiled step %s unreadable (%s: %s); compiling it again", path.name, type(e).__name__, e)
        path.unlink(missing_ok=True)
        return None


def store_executable(folder: Path | None, key: str, compiled) -> None:
    """Keep `compiled` under `key` in `folder`, written whole or not at all."""
    if folder is None:
        return
    try:
        blob = pickle.dumps(serialize(compiled))
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{key}.{os.getpid()}.tmp"
        tmp.write_bytes(blob)
        os.replace(tmp, folder / f"{key}.bin")
    except Exception as e:  # a read-only disk, or a step that cannot be serialized
        log.info("compiled step not kept (%s: %s)", type(e).__name__, e)


_seen = threading.local()  # JAX's cache hits, per compiling thread
_listening = False


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _seen.hits = getattr(_seen, "hits", 0) + 1


def compile_and_keep(folder: Path | None, key: str, lowered, options: dict | None = None):
    """`lowered.compile(options)`, kept under `key` in `folder` unless JAX's persistent cache answered
    the compile: an executable read from that cache serializes without its code on some backends
    (the CPU's: loading it back fails at its first call with "Function ... not found"), so only
    what XLA itself compiled is kept. -> (the executable, whether JAX's cache answered)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    before = getattr(_seen, "hits", 0)
    exe = lowered.compile(options or None)
    answered = getattr(_seen, "hits", 0) != before
    if not answered:
        store_executable(folder, key, exe)
    return exe, answered
