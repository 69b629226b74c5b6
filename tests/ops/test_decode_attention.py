"""The decode-attention kernel and the decode prologue against the XLA path's functions, in Pallas
interpret mode on the CPU, over paged KV pools (`kv.paged`): random pools read through shuffled
block tables, pages under tiles of every relation to them, partly written pages, rings of blocks
under sliding windows, padding rows, int8 pools and keys rebuilt from values, soft-capping; the
prologue's writes at each row's block and offset, and nothing else."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import paged_pools
import pytest

from jaxllm.kv.blockwise import quantize_kv
from jaxllm.ops import gpu as kernels
from jaxllm.ops.gpu.attention import decode_attention
from jaxllm.ops.gpu.prologue import SplitQKV, decode_prologue
from jaxllm.ops.xla import HeadPrep, KeysFromValues, apply_rope, attend, attention_mask, rms_norm

L = 3


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _reference(q, values, table, layer, pos, window, softcap, scale, keys=None):
    """Attention of q [B, H, hd] at pos [B] over the rows' logical positions, read through their
    tables from the pool's float32 values (keys rebuilt from the values where `keys` says how)."""
    S = int(max(pos.max(), 0)) + 1
    v = paged_pools.logical(values["v"], table, layer, S)
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (q.shape[0], S))
    k = (paged_pools.logical(values["k"], table, layer, S) if keys is None
         else apply_rope(rms_norm(v, keys.norm_w, keys.eps, keys.offset), kv_pos, keys.inv_freq))
    mask = attention_mask(jnp.asarray(pos)[:, None], kv_pos, window)
    return attend(q[:, None], k, v, mask, scale, softcap)[:, 0]


def _rebuilt(rng, hd):
    inv_freq = (1.0 / 100.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    inv_freq[hd // 4:] = 0.0                         # partial rotary, as Gemma 4's global layers
    return KeysFromValues(inv_freq, jnp.asarray(rng.standard_normal(hd) * 0.3, jnp.float32), 1e-6, 1.0)


# Pages of 8 positions under tiles of 4 to 64 (a tile inside a page, a page a tile, tiles of several
# pages, each gathered from shuffled blocks), over the chunks of the split or in one.
TILINGS = [(None, None, None), (16, 1, False), (8, 2, True), (4, 5, True)]


@pytest.mark.parametrize("B,H,K,hd,M,window,softcap,pos,int8,from_values", [
    # global: a partly written last page, a nearly empty row, padding (no key to see)
    (3, 8, 2, 32, 8, None, None, [5, 60, -1], False, False),
    # sliding, a narrow table read as a ring of blocks (4 columns for a window of 14): rows past
    # several wraps (a window across two tiles of 64, wider than the table), within the first,
    # and at position 0; head_dim 48, 3 query heads a KV head
    (3, 6, 2, 48, 4, 14, 30.0, [70, 9, 0], False, False),
    (2, 8, 2, 32, 4, 14, None, [77, 22], True, False),       # the ring in int8 (KVOptions.int8_rings)
    (2, 8, 2, 32, 8, None, None, [3, 63], True, False),      # int8 global, a scale per position and head
    (2, 8, 2, 32, 8, None, None, [40, 11], True, True),      # Gemma 4 k_eq_v: keys rebuilt from int8 values
    (2, 4, 1, 48, 8, None, 20.0, [63, 30], False, True),     # the same from float32 values, halves of 24
])
def test_decode_attention(B, H, K, hd, M, window, softcap, pos, int8, from_values):
    """The decode kernel over a random pool through shuffled block tables, against attention over
    the rows' logical positions, for every tiling of the pages; padding rows give zeros."""
    rng = np.random.default_rng(hd + M + int8 * 2 + from_values)
    N, P = 2 * M + 3, 8
    arrays, values = paged_pools.pool(rng, L, N, P, K, hd, int8=int8, keys=not from_values)
    table = paged_pools.table(rng, B, M, N)
    q = jnp.asarray(rng.standard_normal((B, H, hd)), jnp.float32)
    pos = np.asarray(pos, np.int32)
    keys = _rebuilt(rng, hd) if from_values else None
    ref = _reference(q, values, table, 1, pos, window, softcap, 0.3, keys)
    seen = pos >= 0
    for block, splits, prefetch in TILINGS:
        o = decode_attention(q, arrays, jnp.int32(1), table, jnp.asarray(pos), scale=0.3, softcap=softcap,
                             window=window, keys=keys, block=block, splits=splits, prefetch=prefetch)
        assert float(jnp.max(jnp.abs(o[seen] - ref[seen]))) < 1e-5, (block, splits, prefetch)
        assert not np.asarray(o[~seen]).any()


def test_head_pieces_cover_the_head_once():
    """Rebuilt keys read the head dimension as the rotated part of each half, then the rest in
    power-of-two pieces: Gemma 4's global layers (512, a quarter rotated) exactly so."""
    from jaxllm.config.model import RopeSpec
    from jaxllm.ops.gpu.attention import head_pieces
    from jaxllm.ops.xla import inv_frequencies
    inv = inv_frequencies(RopeSpec(kind="proportional", theta=1e6, partial=0.25), 512)
    assert head_pieces(512, inv) == (64, ((0, 64), (256, 64), (64, 128), (192, 64), (320, 128), (448, 64)))
    assert head_pieces(512, None) == (0, ((0, 512),))
    for hd, n_rot in [(48, 12), (32, 16), (64, 8), (200, 30), (16, 0)]:
        inv = np.zeros(hd // 2, np.float32)
        inv[:n_rot] = 1.0
        rot, pieces = head_pieces(hd, inv)
        assert rot == max(n_rot, 1) and pieces[:2] == ((0, rot), (hd // 2, rot))
        covered = sorted(i for st, w in pieces for i in range(st, st + w))
        assert covered == list(range(hd)), (hd, n_rot, pieces)


@pytest.mark.parametrize("M,int8,hd,dtype,shared", [
    (4, False, 32, "float32", False),       # global: positions in 3 pages of shuffled blocks, -1 not written
    (4, True, 48, "float32", True),         # int8, values only (k_eq_v), halves of 24
    (2, True, 32, "float32", False),        # int8 ring of 2 columns: position 25 wraps to column 1
    (2, False, 64, "bfloat16", False),      # bf16 ring
])
def test_decode_prologue(M, int8, hd, dtype, shared):
    """Norms, RoPE and the pool write of one token per row in one kernel, against the XLA path's
    functions: queries, the written entries (keys, values, int8 scales) at each row's block
    (table[b, (pos // P) % M]) and offset, and every other entry left as it was."""
    rng = np.random.default_rng(5)
    B, H, K, L, N, P = 3, 4, 2, 2, 9, 8
    dt = jnp.dtype(dtype)
    q, k = (jnp.asarray(rng.standard_normal((B, n, hd)), dt) for n in (H, K))
    v = k if shared else jnp.asarray(rng.standard_normal((B, K, hd)), dt)
    pos = jnp.asarray([3, 20, -1] if M == 4 else [25, -1, 6], jnp.int32)
    inv_freq = (1.0 / 100.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    qn, kn = (jnp.asarray(rng.standard_normal(hd) * 0.3, dt) for _ in range(2))
    prep = HeadPrep(inv_freq, qn, kn, v_norm=shared, eps=1e-6, offset=1.0)
    if dtype == "bfloat16":               # norm weights read in their layer stacks
        prep = dataclasses.replace(prep, q_norm=jnp.stack([kn, qn]), k_norm=jnp.stack([qn, kn]), norm_layer=1)
    store = jnp.int8 if int8 else dt
    pool = {"v": jnp.asarray(rng.integers(-9, 9, (L, N, P, K, hd)), store)}
    if not shared:
        pool["k"] = jnp.asarray(rng.integers(-9, 9, (L, N, P, K, hd)), store)
    if int8:
        pool.update({f"{n}_scale": jnp.full((L, N, P, K), 0.5, jnp.float32) for n in pool})
    table = paged_pools.table(rng, B, M, N)
    before = {n: np.asarray(a) for n, a in pool.items()}
    qo, got = decode_prologue(q, k, v, prep, pos, pool, jnp.int32(1), table)

    p = pos[:, None]
    assert _rel(qo, apply_rope(rms_norm(q[:, None], qn, 1e-6, 1.0), p, inv_freq)[:, 0]) < 1e-6
    want = {"k": apply_rope(rms_norm(k[:, None], kn, 1e-6, 1.0), p, inv_freq)[:, 0],
            "v": rms_norm(v, None, 1e-6) if shared else v}
    exp = {n: a.copy() for n, a in before.items()}
    for b in range(B):
        if int(pos[b]) < 0:
            continue
        at = (1, int(table[b, (int(pos[b]) // P) % M]), int(pos[b]) % P)
        for n in ("k", "v"):
            if n in pool:
                ref = want[n][b]
                if int8:
                    ref, exp[n + "_scale"][at] = (np.asarray(x) for x in quantize_kv(ref))
                exp[n][at] = np.asarray(ref.astype(store))
    for n in pool:
        np.testing.assert_allclose(np.asarray(got[n]).astype(np.float32), exp[n].astype(np.float32), rtol=1e-6,
                                   atol=0 if int8 else 2e-2 if dtype == "bfloat16" else 1e-6, err_msg=n)


def _same_store(got, want):
    """Pool entries the kernel wrote against the XLA path's: equal in interpret mode; compiled,
    where the float32 sums round in another order, within a rounding of the stored type (one int8
    step, or its epsilon relative to the value plus 1e-6 of the largest)."""
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if kernels.interpret():
        np.testing.assert_array_equal(g, w)
    elif got.dtype == jnp.int8:
        assert np.abs(g - w).max() <= 1
    else:
        np.testing.assert_allclose(g, w, rtol=float(jnp.finfo(got.dtype).eps), atol=1e-6 * np.abs(w).max())


@pytest.mark.parametrize("shared,dtype,scaled,int8", [(False, "float32", True, False), (True, "bfloat16", False, True),
                                                      (False, "bfloat16", True, True)])
def test_decode_prologue_sums_split_projections(shared, dtype, scaled, int8):
    """Q/K/V as a K-split matmul's float32 partials: summed, scaled per channel from the scale
    stacks at their index and rounded to the model dtype in the kernel, as if they had arrived
    summed; and the same for queries alone."""
    rng = np.random.default_rng(8)
    B, H, K, L, N, P, hd, n = 2, 4, 2, 3, 5, 8, 32, 3
    dt = jnp.dtype(dtype)
    parts = {m: jnp.asarray(rng.standard_normal((n, B, c, hd)), jnp.float32) for m, c in (("q", H), ("k", K), ("v", K))}
    scales = {m: jnp.asarray(rng.uniform(0.5, 2.0, (L, c, hd)), jnp.float32) if scaled else None
              for m, c in (("q", H), ("k", K), ("v", K))}
    if shared:
        parts["v"], scales["v"] = parts["k"], scales["k"]
    whole = {m: ((p.sum(0) * scales[m][2]) if scaled else p.sum(0)).astype(dt) for m, p in parts.items()}
    inv_freq = (1.0 / 100.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    qn, kn = (jnp.asarray(rng.standard_normal(hd) * 0.3, dt) for _ in range(2))
    prep = HeadPrep(inv_freq, qn, kn, v_norm=shared, eps=1e-6, offset=1.0)
    store = jnp.int8 if int8 else dt
    pool = {"v": jnp.zeros((L, N, P, K, hd), store)}
    if not shared:
        pool["k"] = jnp.zeros((L, N, P, K, hd), store)
    if int8:
        pool.update({f"{m}_scale": jnp.ones((L, N, P, K), jnp.float32) for m in list(pool)})
    table = paged_pools.table(rng, B, 2, N)
    pos = jnp.asarray([4, 1], jnp.int32)
    split = SplitQKV((scales["q"], scales["k"], scales["v"]), jnp.int32(2), dt)
    want_q, want = decode_prologue(whole["q"], whole["k"], whole["v"], prep, pos, pool, jnp.int32(1), table)
    got_q, got = decode_prologue(parts["q"], parts["k"], parts["v"], prep, pos, pool, jnp.int32(1), table,
                                 split=split)
    assert got_q.dtype == dt and _rel(got_q, want_q) < 1e-6
    for m in want:
        _same_store(got[m], want[m])
    only = SplitQKV((scales["q"], None, None), jnp.int32(2), dt)
    got_q, none = decode_prologue(parts["q"], None, None, prep, pos, {}, 0, split=only)
    assert none == {} and _rel(got_q, decode_prologue(whole["q"], None, None, prep, pos, {}, 0)[0]) < 1e-6


def test_decode_prologue_queries_only():
    """A layer reading another layer's KV blocks: queries alone, nothing written."""
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, 4, 24)), jnp.float32)
    qn = jnp.asarray(rng.standard_normal(24) * 0.3, jnp.float32)
    inv_freq = (1.0 / 100.0 ** (np.arange(0, 24, 2) / 24)).astype(np.float32)
    pos = jnp.asarray([7, 0], jnp.int32)
    qo, got = decode_prologue(q, None, None, HeadPrep(inv_freq, qn, None), pos, {}, 0)
    assert got == {}
    assert _rel(qo, apply_rope(rms_norm(q[:, None], qn, 1e-6), pos[:, None], inv_freq)[:, 0]) < 1e-6
