"""The one engine builder: an `EngineConfig` in, an `Engine` out, for a model's weights (`weights.
load_model`) and for random weights of a named architecture (`weights.random`) alike, with its
draft model, tokenizer, mesh and backend."""

from __future__ import annotations

from jaxllm import ops
from jaxllm.config.engine import EngineConfig
from jaxllm.engine.compilation_cache import enable
from jaxllm.engine.engine import DTYPES, Engine
from jaxllm.engine.speculative import Speculation
from jaxllm.model.families import abstract
from jaxllm.model.presets import load_preset
from jaxllm.model.sharding import check_divisible, layout_for
from jaxllm.tokenizer import IdsTokenizer, shape_tokenizer
from jaxllm.weights import loader, locate
from jaxllm.weights.random import random_weights
from jaxllm.weights.weights import weight_format


def build_engine(config: EngineConfig, progress=None) -> Engine:
    """The engine `config` describes. `progress(n, total)` is called as a model's tensors load."""

    c = config
    if c.shape is None:
        locate(c.model_dir)  # a missing model, or one stored in a format that cannot load, refused before the mesh
    enable(c.caches.compilation)  # before the weights' conversions compile (the engine keeps its calls there)
    layout = layout_for(c.tp, c.dp)
    prepare = ops.select(c.runtime, layout).prepare_weights
    dtype = DTYPES[c.dtype]
    if c.shape is not None:
        cfg, weights = _random(c.shape, c, layout, c.seed, c.shape_overrides)
        tok = IdsTokenizer() if c.tokenizer is None else shape_tokenizer(c.tokenizer, cfg.vocab_size)
        name = c.name
    else:
        cfg, _, weights, tok, name = loader.load_model(c.model_dir, dtype, c.quant, progress, layout, c.caches)
    weights = prepare(weights, abstract(cfg), donate=True)  # the loader's arrays: ours to consume
    spec, draft, dcfg = None, None, None
    if c.speculative == "draft":
        if c.draft_shape is not None:
            dcfg, draft = _random(c.draft_shape, c, layout, c.seed + 1, {})
        else:
            dcfg, _, draft, _, _ = loader.load_model(c.draft_model_dir, dtype, c.quant, None, layout, c.caches)
        draft = prepare(draft, abstract(dcfg), donate=True)
    if c.speculative is not None:
        always = {"min_accept": 0.0, "max_batch": None} if c.draft_always else {"max_batch": c.speculative_max_batch}
        spec = Speculation(c.speculative, c.num_speculative_tokens, draft_cfg=dcfg, **always)
    max_ctx = c.max_ctx if c.max_ctx is not None else cfg.default_ctx
    return Engine(
        cfg,
        weights,
        tok,
        dtype=c.dtype,
        max_ctx=int(max_ctx),
        name=name,
        quant=c.quant,
        layout=layout,
        kv_quant=c.kv_quant,
        kv_options=c.kv_options,
        speculation=spec,
        draft_weights=draft,
        runtime=c.runtime,
        caches=c.caches,
    )


def _random(shape: str, c: EngineConfig, layout, seed: int, overrides: dict):
    """(config, weights) of random weights of the architecture `shape`, made in their shardings."""

    cfg, fam = load_preset(shape, **overrides)
    specs = fam.abstract(cfg)
    check_divisible(layout, specs)
    shardings = layout.weight_shardings(specs, lambda s: weight_format(s, c.quant))
    return cfg, random_weights(specs, c.quant, DTYPES[c.dtype], seed, shardings)
