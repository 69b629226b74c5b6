"""Mixture-of-experts feed-forward: the router, and the experts over the tokens routed to them.

One router serves every family (`route`): softmax over all experts, the top k, then the switches of
`config.model.MoeSpec` (Qwen3-MoE: renormalized top-k weights where `norm_topk_prob`; Gemma 4: a
normed and scaled router input, always renormalized, a learned factor per expert).

Expert weights are stacked on a leading "expert" axis: gate and up together as [E, D, 2, F], down
as [E, F, D] (plain arrays, int8 `QuantArray`s whose scale is per expert and output channel,
[E, 2, F] and [E, D], or FP8 ones with a scale per block). The (token, expert) pairs the router
picked are sorted by expert and fed to `lax.ragged_dot`, a grouped matmul: only the chosen experts
run for each token, and no [tokens, E, F] activation is ever built. At decode (few tokens) each
token instead gathers its k experts' weights, so memory traffic is k experts per token, not the
whole stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config.model import MoeSpec
from jaxllm.ops.xla import activation, rms_norm
from jaxllm.quant import operand

# A routed layer's weights (those of them its `MoeSpec` asks for).
MOE_WEIGHTS = ("router", "router_scale", "expert_scale", "experts_gate_up", "experts_down")


def route(moe: MoeSpec, w: dict, x: jax.Array, eps: float):
    """x [N, D] -> (top-k expert ids [N, k], their weights [N, k] float32); `w` holds the layer's
    "router" [E, D] (and "router_scale" [D], "expert_scale" [E] where `moe` asks for them)."""
    if moe.router_norm:
        D = x.shape[-1]
        x = rms_norm(x, None, eps) * w["router_scale"].astype(x.dtype) * jnp.asarray(D**-0.5, x.dtype)
    scores = jnp.einsum("nd,ed->ne", x, w["router"].astype(x.dtype), preferred_element_type=jnp.float32)
    top_w, top_i = jax.lax.top_k(jax.nn.softmax(scores, axis=-1), moe.top_k)
    if moe.norm_topk:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    if moe.expert_scale:
        top_w = top_w * w["expert_scale"].astype(jnp.float32)[top_i]
    return top_i, top_w


def routed_mlp(moe: MoeSpec, w: dict, x: jax.Array, act: str, eps: float, route_on: jax.Array | None = None):
    """The experts' output for x [..., D]: each token through the experts the router picks for it
    (from `route_on`, default x itself; Gemma 4 routes on the residual stream, feeds its experts a
    differently normed one)."""
    flat = x.reshape(-1, x.shape[-1])
    top_i, top_w = route(moe, w, flat if route_on is None else route_on.reshape(flat.shape), eps)
    y = moe_ffn(flat, top_i, top_w, w["experts_gate_up"], w["experts_down"], act)
    return y.reshape(x.shape)


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, expert: jax.Array) -> jax.Array:
    """x [M, K] with rows sorted by expert (group_sizes[e] rows for expert e), w [E, K, *out]
    -> float32 [M, *out]; `expert` [M] names each row's expert, for the int8 scales."""
    E, K, out = w.shape[0], w.shape[1], w.shape[2:]
    q, scale = operand(w, x.dtype)
    y = jax.lax.ragged_dot(x, q.reshape(E, K, -1), group_sizes, preferred_element_type=jnp.float32)
    if scale is not None:
        y = y * scale.reshape(E, -1)[expert]
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
    """The chosen experts' weights [N, k, ...] (quantized until here) and any per-channel scales."""
    return operand(jax.tree_util.tree_map(lambda a: a[idx], w), dtype)


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
