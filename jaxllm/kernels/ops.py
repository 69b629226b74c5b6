"""The model-facing side of the kernels: take the model's own operands (a `Stacked` weight of any
rank, a layer's view of the stacked KV cache), decide whether a kernel takes them, and reshape in
and out. Each function returns None where the XLA path should run instead."""
from __future__ import annotations

import math

from . import enabled, note
from .attention import decode_attention
from .matmul import stacked_gated, stacked_matmuls
from ..quant import QuantArray, Stacked

MAX_ROWS = 256         # above this many rows (a prefill) a step is compute-bound: XLA's GEMMs


def _flat(w: Stacked, n_contract: int):
    """[L, *in, *out] (and scales [L, *out]) -> [L, K, N], [L, N] | None, out dims."""
    arr, scale = (w.stack.q, w.stack.scale) if isinstance(w.stack, QuantArray) else (w.stack, None)
    L, kdims, ndims = arr.shape[0], arr.shape[1:1 + n_contract], arr.shape[1 + n_contract:]
    K, N = math.prod(kdims), math.prod(ndims)
    return arr.reshape(L, K, N), (None if scale is None else scale.reshape(L, N)), ndims


def _rows(x, n_contract: int, name: str, K: int, N: int, dtype):
    lead = x.shape[:x.ndim - n_contract]
    M = math.prod(lead)
    if M > MAX_ROWS:
        note(name, (M, K, N, str(dtype)), f"xla ({M} rows > {MAX_ROWS})")
        return None, lead
    return x.reshape(M, K), lead


def stacked_linears(x, ws: list, n_contract: int):
    """One kernel launch for several Stacked weights contracted with the same x (Q, K and V)."""
    flat = [_flat(w, n_contract) for w in ws]
    if len({(W.shape[1], W.dtype, s is None) for W, s, _ in flat}) != 1:
        return None
    K = flat[0][0].shape[1]
    x2, lead = _rows(x, n_contract, "matmul", K, "+".join(str(W.shape[2]) for W, _, _ in flat),
                     flat[0][0].dtype)
    if x2 is None:
        return None
    ys = stacked_matmuls(x2, [(W, s) for W, s, _ in flat], ws[0].idx)
    return [y.reshape(lead + nd) for y, (_, _, nd) in zip(ys, flat)]


def stacked_linear(x, w: Stacked, n_contract: int):
    ys = stacked_linears(x, [w], n_contract)
    return None if ys is None else ys[0]


def gated(x, gate, up, act):
    """act(x @ gate) * (x @ up) in one kernel, for Stacked gate/up weights of the same shape."""
    if not (isinstance(gate, Stacked) and isinstance(up, Stacked)):
        return None
    Wg, sg, ndims = _flat(gate, 1)
    Wu, su, _ = _flat(up, 1)
    if Wg.shape != Wu.shape or Wg.dtype != Wu.dtype or (sg is None) != (su is None):
        return None
    x2, lead = _rows(x, 1, "gated matmul", Wg.shape[1], Wg.shape[2], Wg.dtype)
    if x2 is None:
        return None
    return stacked_gated(x2, (Wg, sg), (Wu, su), gate.idx, act).reshape(lead + ndims)


def cached_attention(q, layer_kv, positions, *, scale, softcap, window):
    """Decode attention (one query token per row) over a layer of the stacked linear cache."""
    B, T, H, hd = q.shape
    if not enabled() or T != 1:
        return None
    k, v = layer_kv.stack["k"], layer_kv.stack["v"]
    o = decode_attention(q[:, 0], k, v, layer_kv.idx, positions[:, 0], scale=scale, softcap=softcap,
                         window=window)
    return o[:, None]
