"""An int8 weights tree back as float32 arrays, to check that int8 weights compute what their
dequantized values do (the float engine's compiled forward run on them)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.model.params import is_spec
from jaxllm.quant import QuantArray


def dequantized(cfg, family, weights):
    """The int8 tree as float32 arrays (each scale broadcast back over its contracted dims)."""
    def one(spec, w):
        if not isinstance(w, QuantArray):
            return w
        lead = (1 if spec.axes[0] == "layers" else 0) + spec.n_batch
        scale = w.scale.reshape(w.scale.shape[:lead] + (1,) * w.n_contract + w.scale.shape[lead:])
        return w.q.astype(jnp.float32) * scale
    return jax.tree_util.tree_map(one, family.abstract(cfg), weights, is_leaf=is_spec)


def logits_on(engine, weights, ids, lengths):
    """`engine.logits` on other weights of the same shapes (its compiled forward reused)."""
    own = engine.weights
    try:
        engine.weights = weights
        return engine.logits(ids, lengths=lengths)
    finally:
        engine.weights = own
