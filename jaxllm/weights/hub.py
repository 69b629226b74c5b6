"""Hugging Face hub ids as --model-dir: the local cache first, a download when online."""

from __future__ import annotations

from pathlib import Path

from jaxllm.errors import ModelError

PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def resolve_hub_id(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelError(f"'{repo_id}' is not a local path, and huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=PATTERNS, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=PATTERNS))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(
            f"'{repo_id}' is not a local path, not in the Hugging Face cache, and could not be downloaded ({first})"
        ) from None
