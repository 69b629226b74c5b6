"""Blockwise attention with an online softmax against a plain float32 softmax attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kv.blockwise import blocks_needed, blockwise_attend, dequantize_kv, linear_loader, quantize_kv

B, H, K, HD, BLOCK, NBLK = 2, 4, 2, 32, 16, 4
S = BLOCK * NBLK
# int8 with a scale per token and head rounds each element by at most amax/254: on unit-normal
# heads of 32 (amax ~3.5) V alone moves an output by up to ~0.014, and rounded keys shift the
# softmax weights a little more (measured max 1.7e-2 over the cases below).
INT8_TOL = 3e-2
PREFILL_T = 8


def reference(q, qpos, k, v, window=None, softcap=None, scale=HD ** -0.5):
    """Plain float64 softmax over the visible keys of a linear cache (slot s = position s)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T = q.shape[1]
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            p = qpos[b, t]
            if p < 0:
                continue
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(H):
                kh = h // (H // K)
                s = k[b, lo:p + 1, kh] @ q[b, t, h] * scale
                if softcap is not None:
                    s = np.tanh(s / softcap) * softcap
                w = np.exp(s - s.max())
                out[b, t, h] = (w / w.sum()) @ v[b, lo:p + 1, kh]
    return out


def random_qkv(seed, T):
    r = np.random.default_rng(seed)
    return (r.standard_normal((B, T, H, HD), np.float32), r.standard_normal((B, S, K, HD), np.float32),
            r.standard_normal((B, S, K, HD), np.float32))


@jax.jit
def _attend(q, qpos, k, v, ks, vs):
    load = linear_loader(k, v, ks, vs, block=BLOCK, dtype=jnp.float32)
    return blockwise_attend(q, qpos, load, n_slots=S, block=BLOCK, scale=HD ** -0.5)


def run(q, qpos, k, v, int8, **kw):
    k, v, ks, vs = jnp.asarray(k), jnp.asarray(v), None, None
    if int8:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
    args = (jnp.asarray(q), jnp.asarray(qpos, jnp.int32), k, v, ks, vs)
    if not kw:
        return np.asarray(_attend(*args))
    load = linear_loader(*args[2:], block=BLOCK, dtype=jnp.float32)
    return np.asarray(blockwise_attend(args[0], args[1], load, n_slots=S, block=BLOCK, scale=HD ** -0.5, **kw))


@pytest.mark.parametrize("length", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 3 * BLOCK + 5, S])
def test_decode_and_prefill_across_block_boundaries(length):
    # Decode: one query at the last filled position; the two rows stand at different lengths.
    q, k, v = random_qkv(length, 1)
    qpos = np.array([[length - 1], [max(0, length - 7)]])
    ref = reference(q, qpos, k, v)
    err_f = np.abs(run(q, qpos, k, v, int8=False) - ref).max()
    err_8 = np.abs(run(q, qpos, k, v, int8=True) - ref).max()
    # Prefill: a chunk of queries ending at the last filled position (earlier than 0 = padding).
    qp, _, _ = random_qkv(length + 100, PREFILL_T)
    ppos = np.broadcast_to(np.maximum(np.arange(length - PREFILL_T, length), -1), (B, PREFILL_T))
    ref_p = reference(qp, ppos, k, v)
    err_pf = np.abs(run(qp, ppos, k, v, int8=False) - ref_p).max()
    err_p8 = np.abs(run(qp, ppos, k, v, int8=True) - ref_p).max()
    print(f"length {length}: decode err f32 {err_f:.2e} int8 {err_8:.2e}; "
          f"prefill err f32 {err_pf:.2e} int8 {err_p8:.2e}")
    assert err_f < 1e-5 and err_pf < 1e-5
    assert err_8 < INT8_TOL and err_p8 < INT8_TOL


def test_window_softcap_and_padding_queries():
    q, k, v = random_qkv(7, 6)
    qpos = np.array([[40, 41, 42, 43, -1, -1], [10, 11, 12, 13, 14, 15]])
    out = run(q, qpos, k, v, int8=False, window=9, softcap=5.0)
    ref = reference(q, qpos, k, v, window=9, softcap=5.0)
    print("window+softcap err", np.abs(out - ref).max())
    assert np.abs(out - ref).max() < 1e-5
    assert np.all(out[0, 4:] == 0)          # padding queries see nothing and give zeros


def test_only_filled_blocks_are_read():
    """Slots past the highest query position are never loaded: NaNs there would poison the output."""
    q, k, v = random_qkv(3, 1)
    filled = BLOCK + 3
    k[:, 2 * BLOCK:] = np.nan
    v[:, 2 * BLOCK:] = np.nan
    qpos = np.array([[filled - 1], [5]])
    out = run(q, qpos, k, v, int8=False)
    assert np.isfinite(out).all()
    assert np.abs(out - reference(q, qpos, k[:, :filled], v[:, :filled])).max() < 1e-5
    assert int(blocks_needed(jnp.asarray(qpos), BLOCK, S)) == 2
    assert int(blocks_needed(jnp.asarray([[-1]]), BLOCK, S)) == 0
    assert int(blocks_needed(jnp.asarray([[S + 40]]), BLOCK, S)) == NBLK


def test_int8_roundtrip_scale_per_token_and_head():
    x = np.random.default_rng(0).standard_normal((3, 5, 2, HD)).astype(np.float32) * 7
    x[0, 0, 1] = 0                            # an all-zero head keeps a usable scale
    q, s = quantize_kv(jnp.asarray(x))
    assert q.dtype == jnp.int8 and s.shape == (3, 5, 2)
    back = np.asarray(dequantize_kv(q, s, jnp.float32))
    bound = np.abs(x).max(-1, keepdims=True) / 254 + 1e-6
    assert np.all(np.abs(back - x) <= bound)
    assert np.all(back[0, 0, 1] == 0)


@pytest.mark.parametrize("window", [None, 100])
def test_long_linear_cache_is_read_by_blocks_up_to_the_queries(window):
    """The XLA backend reads a long layer of the linear cache (`LayerKV`) block by block from the
    stack: equal to attention over the whole layer, for decode and prefill rows, the leading rows
    or named ones; a block past the highest query position, or before a sliding window, is never
    read (NaNs there would poison the output)."""
    from jaxllm.kv.linear import LayerKV, slot_positions
    from jaxllm.ops import XlaOps
    from jaxllm.ops.xla import attend, attention_mask
    n, R, L, blk = 2, 3, 1024, 512       # two blocks of 512
    at = 100 if window is None else 700   # the queries' block: the first, or the second with a window
    r = np.random.default_rng(5)
    stack = {name: r.standard_normal((n, R, L, K, HD), np.float32) for name in ("k", "v")}
    for a in stack.values():
        a[1, :, blk:] = a[1, :, :blk] = np.nan
        a[1, :, at // blk * blk:at // blk * blk + blk] = r.standard_normal((R, blk, K, HD))
    stack = {name: jnp.asarray(a) for name, a in stack.items()}
    T = PREFILL_T
    cases = [(None, 2, np.array([[at + 9], [at]])),                                  # decode, leading rows
             (jnp.asarray([2, 0], jnp.int32), None, np.array([[at + t for t in range(T)],
                                                                [-1] * 2 + [at + t for t in range(T - 2)]]))]
    for rows, batch, qpos in cases:
        lkv = LayerKV(stack, jnp.int32(1), rows, batch)
        q = jnp.asarray(r.standard_normal((2, qpos.shape[1], H, HD), np.float32))
        out = XlaOps().cache_attention(q, lkv, jnp.asarray(qpos, jnp.int32), scale=HD ** -0.5, softcap=5.0,
                                       window=window)
        lc = jax.tree_util.tree_map(jnp.nan_to_num, lkv.layer())
        ref = attend(q, lc["k"], lc["v"], attention_mask(jnp.asarray(qpos), slot_positions(2, L), window),
                     HD ** -0.5, 5.0)
        ref = jnp.where(jnp.asarray(qpos >= 0)[..., None, None], ref, 0.0)
        assert np.isfinite(np.asarray(out)).all()
        assert np.abs(np.asarray(out) - np.asarray(ref)).max() < 1e-5
