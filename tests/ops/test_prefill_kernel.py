"""The Pallas prefill-attention kernel against XLA's `layers.attend`, in Pallas interpret mode on the
CPU: query and key blocks with edge tiles, grouped heads, a head width that is not a power of two,
sliding windows (blocks before the window skipped), soft-capping, prompts continued at an offset,
a cache longer than the prompt, and bf16."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import RuntimeConfig, ops
from jaxllm.kv.linear import LayerKV, slot_positions
from jaxllm.ops import gpu as kernels
from jaxllm.ops.gpu.dispatch import stacked_prefill
from jaxllm.ops.gpu.prefill import Blocks, choose_blocks, prefill_attention
from jaxllm.ops.xla import attend, attention_mask

L = 2


def _case(B, T, H, K, S, hd, start, dtype, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, hd)), dtype)
    ks = jnp.asarray(rng.standard_normal((L, B, S, K, hd)), dtype)
    vs = jnp.asarray(rng.standard_normal((L, B, S, K, hd)), dtype)
    pos = jnp.asarray(np.asarray(start)[:, None] + np.arange(T)[None, :], jnp.int32)
    return q, ks, vs, pos


@pytest.mark.parametrize("B,T,H,K,S,hd,window,softcap,start,blocks", [
    (2, 37, 4, 2, 50, 32, None, None, [0, 5], None),                 # T, S past the last block
    (1, 40, 6, 2, 64, 48, 16, 30.0, [3], Blocks(16, 16, 4)),         # 3 heads a KV head, window, softcap
    (2, 20, 2, 2, 20, 16, None, None, [0, 0], Blocks(16, 16, 4)),    # the cache exactly the prompt
    (1, 33, 2, 1, 200, 64, 8, None, [150], Blocks(16, 32, 4)),       # window: early blocks skipped
    (2, 5, 4, 4, 96, 32, None, None, [0, 60], Blocks(16, 16, 4)),    # short prompts, long cache
    (1, 20, 2, 1, 30, 256, 12, None, [0], None),                     # wide heads, their default blocks
    (1, 17, 2, 1, 40, 512, None, None, [10], None),
])
def test_prefill_attention(B, T, H, K, S, hd, window, softcap, start, blocks):
    q, ks, vs, pos = _case(B, T, H, K, S, hd, start, jnp.float32, seed=T + S)
    mask = attention_mask(pos, slot_positions(B, S), window)
    ref = attend(q, ks[1], vs[1], mask, 0.3, softcap)
    o = prefill_attention(q, {"k": ks, "v": vs}, jnp.int32(1), pos, scale=0.3, softcap=softcap, window=window,
                          blocks=blocks)
    assert o.shape == ref.shape and o.dtype == ref.dtype
    # float32 rounding, which grows with the head width the scores sum over (compiled on an H100:
    # 6.9e-6 at head_dim 256 and 1.1e-5 at 512; in interpret mode under 1e-6)
    assert float(jnp.max(jnp.abs(o - ref))) < 5e-6 * max(1, hd / 64)


def test_prefill_attention_over_other_cache_rows():
    """Rows of a prefill read the cache rows `rows` names (the engine core prefills some slots of a
    larger cache), a row past the cache being padding with no position to read."""
    q, ks, vs, _ = _case(4, 21, 4, 2, 48, 32, [0], jnp.float32, seed=9)
    q = q[:3]
    pos = jnp.asarray([[p + t if p >= 0 else -1 for t in range(21)] for p in (10, 0, -1)], jnp.int32)
    rows = jnp.asarray([2, 0, 4], jnp.int32)
    o = prefill_attention(q, {"k": ks, "v": vs}, jnp.int32(1), pos, rows=rows, scale=0.3, blocks=Blocks(16, 16, 4))
    for b, r in enumerate([2, 0]):
        mask = attention_mask(pos[b:b + 1], slot_positions(1, 48), None)
        ref = attend(q[b:b + 1], ks[1, r:r + 1], vs[1, r:r + 1], mask, 0.3, None)
        assert float(jnp.max(jnp.abs(o[b:b + 1] - ref))) < 5e-6
    assert float(jnp.max(jnp.abs(o[2]))) == 0.0            # padding: nothing to attend to


def test_prefill_attention_bf16():
    q, ks, vs, pos = _case(1, 70, 8, 2, 80, 64, [0], jnp.bfloat16, seed=1)
    ref = attend(q, ks[0], vs[0], attention_mask(pos, slot_positions(1, 80), None), 0.125, None)
    o = prefill_attention(q, {"k": ks, "v": vs}, jnp.int32(0), pos, scale=0.125)
    assert o.dtype == jnp.bfloat16
    err = jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32))
    assert float(jnp.max(err)) < 3e-2 and float(jnp.mean(err)) < 3e-3


def test_prefill_blocks_by_head_width():
    for hd, T in [(64, 2048), (128, 2048), (256, 2048), (512, 2048), (48, 5), (128, 20)]:
        b = choose_blocks(hd, T)
        assert b.bq >= 16 and b.bk >= 16 and b.bq * max(hd, 16) <= 64 * 256, (hd, T, b)
        assert b.bq <= max(16, 1 << (T - 1).bit_length()), (hd, T, b)


def test_prefill_kernel_selection():
    """With the kernels forced on, attention of several queries a row over a linear cache runs the
    prefill kernel and logs it; with the XLA path forced, nothing is chosen and XLA runs it."""
    q, ks, vs, pos = _case(1, 9, 4, 2, 16, 16, [0], jnp.float32, seed=2)
    ref = attend(q, ks[0], vs[0], attention_mask(pos, slot_positions(1, 16), None), 0.25, None)
    for mode in ("pallas", "xla"):
        backend = ops.select(RuntimeConfig(kernels=mode))
        kernels._seen.clear()
        layer = LayerKV({"k": ks, "v": vs}, jnp.int32(0))
        out = backend.cache_attention(q, layer, pos, scale=0.25, softcap=None, window=None)
        chosen = [s["choice"] for s in kernels.selections() if s["kernel"] == "prefill attention"]
        if mode == "xla":
            assert out is None and not chosen
        else:
            assert out is not None and chosen and chosen[0].startswith("pallas bq=")
            assert float(jnp.max(jnp.abs(out - ref))) < 5e-6
            with kernels.scope():           # the dispatch function itself, as the backend calls it
                direct = stacked_prefill(q, {"k": ks, "v": vs}, jnp.int32(0), pos, None, scale=0.25,
                                         softcap=None, window=None)
            np.testing.assert_array_equal(np.asarray(direct), np.asarray(out))
        # the cache's attention, whichever runs it
        got = layer.attend(q, pos, backend, scale=0.25, softcap=None, window=None)
        assert float(jnp.max(jnp.abs(got - ref))) < 5e-6, mode
