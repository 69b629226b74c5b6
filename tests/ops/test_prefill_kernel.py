"""The Pallas prefill-attention kernel against attention over the rows' logical positions, in Pallas
interpret mode on the CPU: random paged pools read through shuffled block tables (pages of 8 under
steps of 16 to 64 keys), query and key blocks with edge tiles, grouped heads, a head width that is
not a power of two, sliding windows over rings of blocks (tiles before the window skipped),
soft-capping, prompts continued at an offset, padding, int8 and bf16; and the backend's choice of
kernel against XLA's blockwise attention over the same pool."""
import jax.numpy as jnp
import numpy as np
import paged_pools
import pytest

from jaxllm import RuntimeConfig, ops
from jaxllm.kv.paged import KVPool, LayerKV
from jaxllm.ops import gpu as kernels
from jaxllm.ops.gpu.prefill import Blocks, choose_blocks, prefill_attention
from jaxllm.ops.xla import KeysFromValues, attend, attention_mask

L, P = 2, 8


def _case(B, T, H, K, hd, M, start, seed, int8=False, dtype=jnp.float32):
    """(q, pool arrays, their float32 values, table, positions): row b's queries at start[b]..,
    padding (-1) where start[b] is negative."""
    rng = np.random.default_rng(seed)
    N = B * M + 2
    q = jnp.asarray(rng.standard_normal((B, T, H, hd)), dtype)
    arrays, values = paged_pools.pool(rng, L, N, P, K, hd, int8=int8, dtype=dtype)
    start = np.asarray(start)[:, None]
    pos = jnp.asarray(np.where(start >= 0, start + np.arange(T)[None, :], -1), jnp.int32)
    return q, arrays, values, paged_pools.table(rng, B, M, N), pos


def _reference(q, values, table, pos, window, softcap, scale, layer=1):
    S = int(pos.max()) + 1
    k, v = (paged_pools.logical(values[n], table, layer, S).astype(q.dtype) for n in ("k", "v"))
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (q.shape[0], S))
    return attend(q, k, v, attention_mask(pos, kv_pos, window), scale, softcap)


@pytest.mark.parametrize("B,T,H,K,hd,M,window,softcap,start,int8,blocks", [
    (2, 37, 4, 2, 32, 12, None, None, [0, 5], False, None),              # T past the last query block
    (1, 40, 6, 2, 48, 8, 16, 30.0, [3], False, Blocks(16, 16, 4)),       # 3 heads a KV head, window, softcap
    # a ring of 6 columns (48 positions) under a window of 16, the chunk at 150: early tiles skipped
    (1, 33, 2, 1, 64, 6, 16, None, [150], False, Blocks(16, 32, 4)),
    (3, 5, 4, 4, 32, 12, None, None, [0, 60, -1], True, Blocks(16, 16, 4)),   # int8, short chunks, padding
    (2, 20, 2, 1, 256, 6, 12, None, [0, 40], True, None),                # wide heads, their default blocks
    (1, 17, 2, 1, 512, 6, None, None, [10], False, None),
])
def test_prefill_attention(B, T, H, K, hd, M, window, softcap, start, int8, blocks):
    q, arrays, values, table, pos = _case(B, T, H, K, hd, M, start, seed=T + M, int8=int8)
    ref = _reference(q, values, table, pos, window, softcap, 0.3)
    o = prefill_attention(q, arrays, 1, table, pos, scale=0.3, softcap=softcap, window=window, blocks=blocks)
    assert o.shape == ref.shape and o.dtype == ref.dtype
    seen = np.asarray(pos >= 0)
    # float32 rounding, which grows with the head width the scores sum over (compiled on an H100:
    # 6.9e-6 at head_dim 256 and 1.1e-5 at 512; in interpret mode under 1e-6)
    assert float(jnp.max(jnp.abs(o[seen] - ref[seen]))) < 5e-6 * max(1, hd / 64)
    assert not np.asarray(o[~seen]).any()                 # padding: nothing to attend to


def test_prefill_attention_bf16():
    q, arrays, values, table, pos = _case(1, 70, 8, 2, 64, 10, [0], seed=1, dtype=jnp.bfloat16)
    ref = _reference(q, values, table, pos, None, None, 0.125)
    o = prefill_attention(q, arrays, 1, table, pos, scale=0.125)
    assert o.dtype == jnp.bfloat16
    err = jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32))
    assert float(jnp.max(err)) < 3e-2 and float(jnp.mean(err)) < 3e-3


def test_prefill_blocks_by_head_width():
    for hd, T in [(64, 2048), (128, 2048), (256, 2048), (512, 2048), (48, 5), (128, 20)]:
        b = choose_blocks(hd, T)
        assert b.bq >= 16 and b.bk >= 16 and b.bq * max(hd, 16) <= 64 * 256, (hd, T, b)
        assert b.bq <= max(16, 1 << (T - 1).bit_length()), (hd, T, b)


def test_paged_attention_selection():
    """With the kernels forced on, attention over a layer of a pool runs the prefill kernel for
    several queries a row and the decode kernel for one, and logs it, equal to XLA's blockwise
    attention over the same blocks (what the XLA backend runs); more queries a row over keys
    rebuilt from values go to XLA."""
    q, arrays, _, table, pos = _case(2, 9, 4, 2, 16, 4, [0, 20], seed=2)
    layer = LayerKV(KVPool(arrays["k"], arrays["v"], read=16), np.int32(1), table)
    for T in (9, 1):
        qs, ps = q[:, 9 - T:], pos[:, 9 - T:]           # the last token: the decode step after
        kind = "prefill attention" if T > 1 else "decode attention"
        ref = layer.attend(qs, ps, ops.select(RuntimeConfig(kernels="xla")), scale=0.25, softcap=None, window=None)
        kernels._seen.clear()
        out = ops.select(RuntimeConfig(kernels="pallas")).paged_attention(qs, layer, ps, scale=0.25, softcap=None,
                                                                          window=None)
        chosen = [s["choice"] for s in kernels.selections() if s["kernel"] == kind]
        assert chosen and chosen[0].startswith("pallas") and float(jnp.max(jnp.abs(out - ref))) < 5e-6, T
    values = LayerKV(KVPool(None, arrays["v"], read=16), np.int32(1), table)
    keys = KeysFromValues(np.ones(8, np.float32), None)
    assert ops.select(RuntimeConfig(kernels="pallas")).paged_attention(
        q, values, pos, scale=0.25, softcap=None, window=None, keys=keys) is None
    assert ops.select(RuntimeConfig(kernels="xla")).paged_attention(
        q, layer, pos, scale=0.25, softcap=None, window=None) is None


def test_paged_kernels_lower_for_cuda(lower_for_cuda):
    """The tiles' gathers over pages (a pointer block indexed by vectors) lower to Triton for an
    H100: the decode kernel with tiles of several pages and of one (bf16; int8: the widening
    tests), the prefill kernel over bf16 and int8 pools, and the prologue's writes."""
    from jax import ShapeDtypeStruct as S

    from jaxllm.ops.gpu.attention import decode_attention
    from jaxllm.ops.gpu.prologue import decode_prologue
    from jaxllm.ops.xla import HeadPrep
    B, K, N, M = 2, 2, 9, 4

    def pool(hd, int8=False):
        out = {n: S((L, N, 32, K, hd), jnp.int8 if int8 else jnp.bfloat16) for n in ("k", "v")}
        return {**out, **({n + "_scale": S((L, N, 32, K), jnp.float32) for n in out} if int8 else {})}
    table, pos = S((B, M), jnp.int32), S((B,), jnp.int32)
    for hd in (128, 256):                       # tiles of 64 and of 32 positions
        lower_for_cuda(lambda q, pool, table, pos: decode_attention(q, pool, 1, table, pos, scale=0.1, window=40),
                       S((B, 4, hd), jnp.bfloat16), pool(hd), table, pos)
    for int8 in (False, True):
        lower_for_cuda(lambda q, pool, table, pos: prefill_attention(q, pool, 1, table, pos, scale=0.1, window=40),
                       S((B, 20, 4, 64), jnp.bfloat16), pool(64, int8), table, S((B, 20), jnp.int32))
    prep = HeadPrep(np.ones(32, np.float32))
    kv = S((B, K, 64), jnp.bfloat16)
    lower_for_cuda(lambda q, k, v, pool, table, pos: decode_prologue(q, k, v, prep, pos, pool, 1, table),
                   S((B, 4, 64), jnp.bfloat16), kv, kv, pool(64, True), table, pos)
