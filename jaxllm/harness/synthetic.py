"""Engines of a named architecture with random weights (`weights.random`), for timing and
serving without a checkpoint, and what such a model has for a tokenizer."""
from __future__ import annotations

from jaxllm.errors import RequestError
from jaxllm.weights.random import random_weights
from jaxllm.weights.weights import is_quantized


class IdsTokenizer:
    """What a random-weight model has for a tokenizer: prompts come as token ids, and generated ids
    read back as text, each as a space and its number (so a streamed text counts its tokens)."""
    chat_template = None
    chat_tuned = False
    bos_id = None
    eos_ids = ()

    def decode(self, ids) -> str:
        return "".join(f" {int(i)}" for i in ids)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise RequestError("a model with random weights has no tokenizer: send token ids") from None

    def encode_chat(self, messages) -> list[int]:
        raise RequestError("a model with random weights has no chat template: use /v1/completions with token ids")


def shape_tokenizer(path: str, cfg):
    """The tokenizer in directory `path`, for a random-weight model of config `cfg`."""
    from pathlib import Path

    from jaxllm.errors import ModelError
    from jaxllm.tokenizer import Tokenizer
    tok = Tokenizer.from_hf_dir(Path(path))
    if tok is None:
        raise ModelError(f"{path}: no tokenizer.json")
    n = tok.tok.get_vocab_size()
    if n > cfg.vocab_size:
        raise ModelError(f"{path}: the tokenizer has {n} ids, more than the model's vocabulary of {cfg.vocab_size}")
    return tok


def random_engine(shape: str, *, dtype: str = "bfloat16", quant: str = "int8", max_ctx: int = 4096, layout=None,
                  kv_quant: str = "auto", kv_options=None, seed: int = 0, speculative=None,
                  num_speculative_tokens: int = 4, draft_shape: str | None = None,
                  draft_model_dir: str | None = None, draft_always: bool = False,
                  speculative_max_batch: int | None = 4, tokenizer: str | None = None, runtime=None,
                  compilation_cache=None, **overrides):
    """An Engine of a named architecture (a preset name or a config.json path) with random weights
    made in their shardings on `layout` (default: one device), and no tokenizer (`IdsTokenizer`), or
    the one in the directory `tokenizer` (its tokenizer.json; the model's vocabulary must hold its
    ids), so that features that need text (structured output) can be measured on the shape.
    `speculative` as in `jaxllm.load`; a draft model is a random `draft_shape` or the real model at
    `draft_model_dir` (the cost of a cycle is the same; what it accepts of random logits is not
    meaningful either way); `draft_always` keeps every row drafting whatever it accepts, for the cost
    of a cycle. `compilation_cache` as in `jaxllm.load`."""
    from jaxllm import ops
    from jaxllm.config.runtime import RuntimeConfig
    from jaxllm.engine.engine import DTYPES, Engine
    from jaxllm.engine.sharding import check_divisible, single_device_layout
    from jaxllm.errors import ModelError
    from jaxllm.model.presets import load_preset
    layout = layout or single_device_layout()
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if quant not in ("int8", "none"):
        raise ModelError(f"quant must be 'int8' or 'none', got {quant!r}")
    from jaxllm.engine.speculative import Speculation, check_args
    if draft_shape is not None and draft_model_dir is not None:
        raise ModelError("a draft model is a random shape or a model directory, not both")
    check_args(speculative, num_speculative_tokens, draft_shape or draft_model_dir)
    runtime = RuntimeConfig.from_env() if runtime is None else runtime
    from jaxllm.engine.compilation_cache import enable
    enable(compilation_cache)            # before the random weights compile
    prepare = ops.select(runtime, layout).prepare_weights

    def build(name, seed, **kw):
        cfg, fam = load_preset(name, **kw)
        specs = fam.abstract(cfg)
        check_divisible(layout, specs)
        shardings = layout.weight_shardings(specs, lambda s: is_quantized(s, quant))
        return cfg, prepare(random_weights(specs, quant, DTYPES[dtype], seed, shardings), donate=True)
    cfg, weights = build(shape, seed, **overrides)
    spec, dcfg, draft = None, None, None
    if speculative == "draft" and draft_model_dir is not None:
        from jaxllm.weights import load_model
        dcfg, _, draft, _, _ = load_model(draft_model_dir, DTYPES[dtype], quant, None, layout)
        draft = prepare(draft, donate=True)
    elif speculative == "draft":
        dcfg, draft = build(draft_shape, seed + 1)
    if speculative is not None:
        always = {"min_accept": 0.0, "max_batch": None} if draft_always else {"max_batch": speculative_max_batch}
        spec = Speculation(speculative, num_speculative_tokens, draft_cfg=dcfg, **always)
    tok = IdsTokenizer() if tokenizer is None else shape_tokenizer(tokenizer, cfg)
    return Engine(cfg, weights, tok, dtype=dtype, max_ctx=max_ctx, name=f"{shape} (random weights)",
                  quant=quant, layout=layout, kv_quant=kv_quant, kv_options=kv_options, speculation=spec,
                  draft_weights=draft, runtime=runtime, compilation_cache=compilation_cache)
