"""Attention over paged KV blocks (XLA's blockwise loop, `kv.paged.LayerKV`) against a plain float64
softmax over each row's positions: blocks in any order, partial last blocks, sliding windows over
narrow tables whose columns the row reuses, int8 blocks, keys rebuilt from values, padding queries."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kv.blockwise import dequantize_kv, quantize_kv
from jaxllm.kv.paged import KVPool, LayerKV, rebuild_keys
from jaxllm.ops import XlaOps
from jaxllm.ops.xla import KeysFromValues, inv_frequencies

B, H, K, HD, P = 2, 4, 2, 32, 8
S = 6 * P                  # positions a row reaches
N = 2 * (S // P) + 3       # blocks in the pool: each row's own, a null block and spares
# int8 with a scale per token and head rounds each element by at most amax/254: on unit-normal
# heads of 32 (amax ~3.5) V alone moves an output by up to ~0.014, and rounded keys shift the
# softmax weights a little more.
INT8_TOL = 3e-2
OPS = XlaOps()


def reference(q, qpos, k, v, window=None, softcap=None, scale=HD ** -0.5):
    """Plain float64 softmax over the positions each query sees; k/v [B, S, K, HD] by position."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(q.shape[1]):
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


def shuffled_tables(width: int, seed: int) -> np.ndarray:
    """[B, width] distinct blocks in a random order (never the null block 0)."""
    r = np.random.default_rng(seed)
    return (1 + r.permutation(N - 1)[:B * width]).reshape(B, width).astype(np.int32)


def written(k, v, table, int8=False, read=2 * P, keys_from_values=False):
    """A one-layer pool holding positions [0, S) of each row (k, v [B, S, K, HD]) in the row's
    blocks, written in chunks of a block through `LayerKV.write`; NaN everywhere else."""
    nan = jnp.full((1, N, P, K, HD), jnp.nan, jnp.float32)
    if int8:
        pool = KVPool(None if keys_from_values else jnp.zeros((1, N, P, K, HD), jnp.int8), jnp.zeros(nan.shape, jnp.int8),
                      None if keys_from_values else jnp.ones(nan.shape[:-1], jnp.float32),
                      jnp.ones(nan.shape[:-1], jnp.float32), read=read)
    else:
        pool = KVPool(None if keys_from_values else nan, nan, read=read)
    lkv = LayerKV(pool, jnp.int32(0), jnp.asarray(table))
    for s in range(0, S, P):
        pos = jnp.broadcast_to(jnp.arange(s, s + P, dtype=jnp.int32), (B, P))
        lkv = lkv.write(None if k is None else jnp.asarray(k[:, s:s + P]), jnp.asarray(v[:, s:s + P]), pos)
    return lkv


def random_qkv(seed, T):
    r = np.random.default_rng(seed)
    return (r.standard_normal((B, T, H, HD), np.float32), r.standard_normal((B, S, K, HD), np.float32),
            r.standard_normal((B, S, K, HD), np.float32))


def attend(lkv, q, qpos, softcap=None, window=None, keys=None):
    return np.asarray(lkv.attend(jnp.asarray(q), jnp.asarray(qpos, jnp.int32), OPS, scale=HD ** -0.5,
                                 softcap=softcap, window=window, keys=keys))


@pytest.mark.parametrize("length", [1, P - 1, P, P + 1, 3 * P + 5, S])
@pytest.mark.parametrize("T", [1, 8])
def test_decode_and_prefill_over_shuffled_blocks(length, T):
    """Queries at the last T positions of a row (the other row one shorter, with padding) over
    blocks in random order, read two blocks a step: any length, inside a block or at its end."""
    q, k, v = random_qkv(length, T)
    lkv = written(k, v, shuffled_tables(S // P, 1))
    qpos = np.stack([np.arange(length - T, length), np.arange(length - T - 1, length - 1)])
    qpos = np.where(qpos >= 0, qpos, -1)
    out = attend(lkv, q, qpos)
    ref = reference(q, qpos, k, v)
    assert np.abs(out - ref).max() < 1e-4
    assert (out[qpos < 0] == 0).all() and np.isfinite(out).all()      # never read: the NaN blocks


@pytest.mark.parametrize("int8", [False, True])
def test_window_softcap_over_a_ring_of_blocks(int8):
    """A sliding window of 11 over a table of 3 columns (24 positions) that the row's blocks take
    in turn: written a block at a time and read after each, it gives the window's attention; int8
    blocks within the rounding of their scales."""
    window, width = 11, 3
    q, k, v = random_qkv(3, 1)
    table = shuffled_tables(width, 2)
    nan = jnp.full((1, N, P, K, HD), jnp.nan, jnp.float32)
    pool = KVPool(nan, nan, read=P) if not int8 else KVPool(
        jnp.zeros(nan.shape, jnp.int8), jnp.zeros(nan.shape, jnp.int8), jnp.ones(nan.shape[:-1]), jnp.ones(nan.shape[:-1]),
        read=P)
    lkv = LayerKV(pool, jnp.int32(0), jnp.asarray(table))
    kr, vr = (k, v) if not int8 else (dequantize_kv(*quantize_kv(jnp.asarray(x)), jnp.float32) for x in (k, v))
    for s in range(0, S, P):
        pos = jnp.broadcast_to(jnp.arange(s, s + P, dtype=jnp.int32), (B, P))
        lkv = lkv.write(jnp.asarray(k[:, s:s + P]), jnp.asarray(v[:, s:s + P]), pos)
        qpos = np.array([[s + P - 1], [s + 3]])
        out = attend(lkv, q, qpos, softcap=5.0, window=window)
        ref = reference(q, qpos, kr, vr, window, 5.0)
        assert np.abs(out - ref).max() < (INT8_TOL if int8 else 1e-4), s


def test_keys_rebuilt_from_values():
    """A pool of values alone: keys are the values RMS-normed and rotated at their positions."""
    q, _, v = random_qkv(4, 2)
    rope = inv_frequencies(type("R", (), {"kind": "default", "theta": 10_000.0, "factor": 1.0, "partial": 1.0})(), HD)
    keys = KeysFromValues(rope, jnp.asarray(np.random.default_rng(9).standard_normal(HD), jnp.float32), 1e-6, 0.0)
    lkv = written(None, v, shuffled_tables(S // P, 3), keys_from_values=True)
    assert lkv.keys_from_values
    qpos = np.array([[S - 2, S - 1], [10, 11]])
    out = attend(lkv, q, qpos, keys=keys)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    k = np.asarray(rebuild_keys(jnp.asarray(v), pos, keys))
    assert np.abs(out - reference(q, qpos, k, v)).max() < 1e-4


def test_only_the_blocks_a_query_sees_are_read():
    """Decode at position 20 with a window of 8 reads the blocks of positions 13..20 alone: a NaN
    in any other block of the row (before the window, past the position) never reaches the output."""
    q, k, v = random_qkv(5, 1)
    table = shuffled_tables(S // P, 4)
    lkv = written(k, v, table, read=P)
    bad = np.array(lkv.pool.k)
    for b in range(B):
        for j in (0, 3, 4, 5):                       # positions 0-7 and 24-47
            bad[0, table[b, j]] = np.nan
    lkv = lkv.replace(pool=lkv.pool.replace(k=jnp.asarray(bad), v=jnp.asarray(bad)))
    out = attend(lkv, q, np.array([[20], [20]]), window=8)
    assert np.isfinite(out).all()


def test_int8_roundtrip_scale_per_token_and_head():
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 3, K, HD)) * 5, jnp.float32)
    x = x.at[0, 0, 1].set(0.0)
    q, s = quantize_kv(x)
    assert q.dtype == jnp.int8 and s.shape == (2, 3, K)
    back = dequantize_kv(q, s, jnp.float32)
    assert np.abs(np.asarray(back - x)).max() <= float(jnp.max(jnp.abs(x))) / 254 + 1e-6
    assert np.all(np.asarray(back[0, 0, 1]) == 0)


def test_writes_at_negative_positions_are_dropped():
    """Padding tokens (position -1) write nothing: not even into the null block."""
    pool = KVPool(jnp.zeros((1, N, P, K, HD)), jnp.zeros((1, N, P, K, HD)), read=P)
    lkv = LayerKV(pool, jnp.int32(0), jnp.zeros((B, 2), jnp.int32))
    ones = jnp.ones((B, 3, K, HD))
    lkv = lkv.write(ones, ones, jnp.full((B, 3), -1, jnp.int32))
    assert not np.asarray(lkv.pool.k).any() and not np.asarray(lkv.pool.v).any()
    jax.block_until_ready(lkv)
