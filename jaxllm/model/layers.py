"""The pieces every family's layer is built from: norms, RoPE, MLP, attention over a KV cache."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config.model import AttnSpec, ModelConfig, RopeSpec
from jaxllm.errors import ModelError
from jaxllm.quant import layer_of, linear, linears, total

NEG_INF = -1e30


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32; `offset=1` is Gemma's (1 + w) scaling, `w=None` is parameter-free."""
    w = layer_of(w)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if w is not None:
        y = y * (offset + w.astype(jnp.float32))
    return y.astype(x.dtype)


def add_norm(x: jax.Array, y, post, pre, eps: float, offset: float = 0.0, h_into=None):
    """The residual add after a block and the next block's input norm: (x + rms_norm(y, post), or
    x + y with `post` None; and that normed with `pre`). One kernel on GPUs (`kernels.norm`), which
    takes y as the matmul's unsummed `Partials` too, and may write the norm over `h_into` (an array
    of the same shape the caller no longer needs) rather than a new buffer."""
    from jaxllm.ops.gpu.dispatch import add_norm as fused
    out = fused(x, y, post, pre, eps, offset, h_into)
    if out is not None:
        return out
    y = total(y)
    if post is not None:
        y = rms_norm(y, post, eps, offset)
    x = x + y
    return x, rms_norm(x, pre, eps, offset)


def inv_frequencies(rope: RopeSpec, head_dim: int) -> np.ndarray:
    """Inverse frequencies over head_dim/2 pairs, the way Hugging Face computes them per rope type."""
    if rope.kind in ("default", "linear"):
        inv = 1.0 / rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    elif rope.kind == "proportional":
        n_rot = int(rope.partial * head_dim // 2)
        inv = 1.0 / rope.theta ** (np.arange(0, 2 * n_rot, 2, dtype=np.float64) / head_dim)
        inv = np.concatenate([inv, np.zeros(head_dim // 2 - n_rot)])
    else:
        raise ModelError(f"unsupported rope type {rope.kind!r} (supported: default, linear, proportional)")
    return (inv / rope.factor).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x [B, T, H, hd], positions [B, T] (absolute). Rotates halves, as HF's rotate_half does."""
    ang = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)      # [B, T, hd/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    raise ModelError(f"unsupported activation {name!r}")


def gated_mlp(cfg: ModelConfig, w: dict, x: jax.Array, partials: bool = False) -> jax.Array:
    """down(act(x @ gate) * (x @ up)); with `partials`, possibly as down's unsummed `Partials`."""
    from jaxllm.ops.gpu.dispatch import gated
    h = gated(x, w["gate"], w["up"], lambda g: activation(cfg.activation, g))
    if h is None:
        h = activation(cfg.activation, linear(x, w["gate"])) * linear(x, w["up"])
    return linear(h, w["down"], partials=partials)


def attention_mask(q_pos: jax.Array, kv_pos: jax.Array, window: int | None) -> jax.Array:
    """[B, T, S] bool: causal, within the sliding window, and only slots that hold a written key.

    `kv_pos[b, s]` is the absolute position held in cache slot s (or -1 for an empty slot); a ring
    buffer stores positions out of order, which is why the mask reads them instead of assuming s.
    """
    qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
    m = (kp <= qp) & (kp >= 0)
    if window is not None:
        m &= kp > qp - window
    return m


def attend(q, k, v, mask, scale: float, softcap: float | None) -> jax.Array:
    """Grouped-query attention. q [B,T,H,hd], k/v [B,S,K,hd], mask [B,T,S] -> [B,T,H,hd]."""
    B, T, H, hd = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, hd)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(mask[:, None, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, hd).astype(q.dtype)


def raw_qkv(cfg: ModelConfig, a: AttnSpec, w: dict, h: jax.Array, partials: bool = False):
    """A layer's Q, K, V projections as they come out of the matmuls (V is the raw K where the
    layer has no V projection of its own); with `partials`, possibly as unsummed `Partials`."""
    q, k, *v = linears(h, [w["q"], w["k"]] + ([] if a.k_eq_v else [w["v"]]), partials=partials)
    return q, k, k if a.k_eq_v else v[0]


def finish_qkv(cfg: ModelConfig, w: dict, q, k, v, positions: jax.Array, inv_freq):
    """Per-head norms, and RoPE on Q and K: what attention and the KV cache take."""
    if cfg.qk_norm:
        k = rms_norm(k, w["k_norm"], cfg.norm_eps, cfg.norm_offset)
    if cfg.v_norm:
        v = rms_norm(v, None, cfg.norm_eps)
    return finish_q(cfg, w, q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def finish_q(cfg: ModelConfig, w: dict, q: jax.Array, positions: jax.Array, inv_freq):
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.norm_eps, cfg.norm_offset)
    return apply_rope(q, positions, inv_freq)
