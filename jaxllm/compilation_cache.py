"""JAX's persistent compilation cache, on by default for every front end: a process that compiles
a step another process has compiled already (same program, same devices, same JAX) reads the
executable from disk instead.

The folder is `$JAXLLM_COMPILATION_CACHE`, else `$XDG_CACHE_HOME/jaxllm/xla` (`~/.cache/jaxllm/xla`);
`--compilation-cache DIR` moves it and `--compilation-cache off` (or the variable set to `off`) turns
it off.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("jaxllm")
OFF = ("off", "none", "0", "false", "no")
MIN_COMPILE_SECONDS = 0.5           # compiles quicker than this are not worth a file


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxllm" / "xla"


def resolve(flag: str | None = None) -> Path | None:
    """The cache folder a flag value (None: not given) asks for, or None for off."""
    value = flag if flag is not None else os.environ.get("JAXLLM_COMPILATION_CACHE")
    if value is not None and value.strip().lower() in OFF:
        return None
    return Path(value).expanduser() if value else default_dir()


def enable(flag: str | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at the folder `resolve(flag)` names (before
    anything compiles); -> the folder, or None when off or when it cannot be created."""
    path = resolve(flag)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache %s cannot be created (%s); compiling without it", path, e.strerror or e)
        return None
    import jax
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def add_flag(parser) -> None:
    parser.add_argument("--compilation-cache", metavar="DIR", default=None,
                        help="persistent compilation cache folder, or 'off' (default: $JAXLLM_COMPILATION_CACHE, "
                             "else ~/.cache/jaxllm/xla)")
