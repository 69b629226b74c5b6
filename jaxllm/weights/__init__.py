"""Find a model (directory, .gguf file, hub id or the embedded default) and read its config;
`weights.loader.load_model` produces (config, family, weights, tokenizer).

Finding a model imports no JAX, so front ends check a model path before JAX loads (reading its
config maps it through its family, which does)."""

from __future__ import annotations

from jaxllm.weights.files import SAVED_META, ModelFiles, locate, read_dir, read_hf_config

__all__ = ["SAVED_META", "ModelFiles", "locate", "read_config", "read_dir", "read_hf_config"]


def read_config(model_dir):
    """The model's `ModelConfig` from its config.json or GGUF metadata alone, no weight or
    tokenizer read: what a front end checks its limits against before loading."""
    files = locate(model_dir)  # a missing model is refused before JAX loads
    from jaxllm.model.families import family_for

    if files.kind == "gguf":
        from jaxllm.weights.gguf import read_gguf_config

        hf = read_gguf_config(files.path)
    else:
        hf = read_hf_config(files.path)[0]
    return family_for(hf).config_from_hf(hf)
