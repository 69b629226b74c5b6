"""Mixture-of-experts feed-forward over routed tokens.

Expert weights are stacked on a leading "expert" axis: gate and up together as [E, D, 2, F], down
as [E, F, D] (plain arrays, or int8 `QuantArray`s whose scale is per expert and output channel,
[E, 2, F] and [E, D]). The (token, expert) pairs the router picked are sorted by expert and fed to
`lax.ragged_dot`, a grouped matmul: only the chosen experts run for each token, and no [tokens, E, F]
activation is ever built. At decode (few tokens) each token instead gathers its k experts' weights,
so memory traffic is k experts per token, not the whole stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.ops.xla import activation
from jaxllm.quant import QuantArray


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, expert: jax.Array) -> jax.Array:
    """x [M, K] with rows sorted by expert (group_sizes[e] rows for expert e), w [E, K, *out]
    -> float32 [M, *out]; `expert` [M] names each row's expert, for the int8 scales."""
    E, K, out = w.shape[0], w.shape[1], w.shape[2:]
    q = w.q if isinstance(w, QuantArray) else w
    y = jax.lax.ragged_dot(x, q.reshape(E, K, -1).astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    if isinstance(w, QuantArray):
        y = y * w.scale.reshape(E, -1)[expert]
    return y.reshape(x.shape[0], *out)


def moe_ffn(x: jax.Array, top_idx: jax.Array, top_w: jax.Array, gate_up, down, act: str) -> jax.Array:
    """x [N, D]; top_idx/top_w [N, k] the router's experts and their weights -> [N, D].

    Each token's output is sum_j top_w[n, j] * down(act(gate(x)) * up(x)) over its k experts.
    Few tokens (decode: N*k <= E) gather their experts' weights; more are grouped by expert.
    """
    N, k = top_idx.shape
    if N * k <= gate_up.shape[0]:
        return _gathered(x, top_idx, top_w, gate_up, down, act)
    return _grouped(x, top_idx, top_w, gate_up, down, act)


def _grouped(x, top_idx, top_w, gate_up, down, act):
    N, k = top_idx.shape
    E = gate_up.shape[0]
    flat = top_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    expert = flat[order]
    token = order // k
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    gu = grouped_matmul(x[token], gate_up, group_sizes, expert)  # [N*k, 2, F]
    h = (activation(act, gu[:, 0]) * gu[:, 1]).astype(x.dtype)
    y = grouped_matmul(h, down, group_sizes, expert)  # [N*k, D]
    y = y * top_w.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((N, x.shape[-1]), jnp.float32).at[token].add(y).astype(x.dtype)


def _take(w, idx, dtype):
    """The chosen experts' weights [N, k, ...] (int8 stays int8 until here) and their scales."""
    if isinstance(w, QuantArray):
        return w.q[idx].astype(dtype), w.scale[idx]
    return w[idx].astype(dtype), None


def _gathered(x, top_idx, top_w, gate_up, down, act):
    """Reads only the k chosen experts' weights per token: what decode wants from memory."""
    wgu, sgu = _take(gate_up, top_idx, x.dtype)  # [N, k, D, 2, F]
    gu = jnp.einsum("nd,nkdcf->nkcf", x, wgu, preferred_element_type=jnp.float32)
    if sgu is not None:
        gu = gu * sgu
    h = (activation(act, gu[..., 0, :]) * gu[..., 1, :]).astype(x.dtype)
    wd, sd = _take(down, top_idx, x.dtype)  # [N, k, F, D]
    y = jnp.einsum("nkf,nkfd->nkd", h, wd, preferred_element_type=jnp.float32)
    if sd is not None:
        y = y * sd
    return jnp.einsum("nkd,nk->nd", y, top_w.astype(jnp.float32)).astype(x.dtype)
