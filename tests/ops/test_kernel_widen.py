"""The three ways the kernels widen int8 (`kernels.widen`) give the conversion's values bit for bit:
alone over every int8, inside the tensor-core matmul and the decode-attention kernel (interpreted),
and each lowers to Triton for an H100."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import paged_pools
import pytest

from jaxllm import RuntimeConfig, ops
from jaxllm.errors import ModelError
from jaxllm.ops import gpu as kernels
from jaxllm.ops.gpu import widen as widening
from jaxllm.ops.gpu.attention import decode_attention
from jaxllm.ops.gpu.matmul import Tiles, choose_tiles, stacked_gated, stacked_matmul
from jaxllm.ops.xla import KeysFromValues

L = 3
ALL = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)


@pytest.mark.parametrize("way", widening.WAYS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_every_int8_exactly(way, dtype):
    got = widening.widen(ALL, dtype, way)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.arange(-128, 128))
    assert widening.widen(got, jnp.float32, way).dtype == jnp.float32      # not int8: a plain cast


def test_default_from_the_runtime_config(monkeypatch):
    """The way `RuntimeConfig.int8_widen` names, declared by the kernel backend while it traces
    (`kernels.scope`); each kernel's own default where it names none."""
    assert widening.default() == "convert" and widening.default("magic") == "magic"
    with kernels.scope(widen="bits"):
        assert widening.default() == "bits" and widening.default("magic") == "bits"
        assert choose_tiles(17, 70, 45, out_major=True).widen == "bits"
    assert widening.default() == "convert" and choose_tiles(17, 70, 45, out_major=True).widen == "convert"
    # through the backend: its kernels widen as its configuration says
    from jaxllm.ops.gpu.types import Stacked
    from jaxllm.quant import QuantArray
    x, w, s = _matmul_inputs()
    stacked = Stacked(QuantArray(w, s, 1), jnp.int32(2), ("mlp", "embed"), out_major=True)
    got = {}
    for way in ("bits", "convert"):
        backend = ops.select(RuntimeConfig(kernels="pallas", int8_widen=way))
        got[way] = np.asarray(backend.linear(x, stacked).astype(jnp.float32))
        chosen = [c["choice"] for c in kernels.selections()
                  if c["kernel"] == "matmul" and c["shape"] == [17, 70, "45", "int8"]]
        assert len(chosen) == 1 and ("widen=bits" in chosen[0]) == (way == "bits"), chosen
    np.testing.assert_array_equal(got["bits"], got["convert"])
    assert RuntimeConfig().int8_widen is None
    with pytest.raises(ModelError, match="int8_widen must be one of convert, magic, bits, got 'fast'"):
        RuntimeConfig(int8_widen="fast")
    # JAXLLM_INT8_WIDEN, as `RuntimeConfig.from_env` reads it
    monkeypatch.delenv("JAXLLM_INT8_WIDEN", raising=False)
    assert RuntimeConfig.from_env().int8_widen is None
    monkeypatch.setenv("JAXLLM_INT8_WIDEN", "Bits")
    assert RuntimeConfig.from_env().int8_widen == "bits"
    monkeypatch.setenv("JAXLLM_INT8_WIDEN", "fast")
    with pytest.raises(ModelError,
                       match="JAXLLM_INT8_WIDEN: int8_widen must be one of convert, magic, bits, got 'fast'"):
        RuntimeConfig.from_env()


def _matmul_inputs(M=17, K=70, N=45):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.integers(-128, 128, (L, N, K)), jnp.int8)
    s = jnp.asarray(rng.random((L, N)) * 0.02 + 0.001, jnp.float32)
    return x, w, s


def test_tensor_core_matmuls_identical():
    x, w, s = _matmul_inputs()
    base = Tiles(bm=16, bn=16, bk=32, split=2, out_major=True)
    act = jax.nn.silu
    ref = stacked_matmul(x, w, s, jnp.int32(2), base, True)
    ref_g = stacked_gated(x, (w, s), (w[::-1], s[::-1]), jnp.int32(1), act, base, True)
    assert jnp.all(jnp.isfinite(ref.astype(jnp.float32)))
    for way in ("magic", "bits"):
        t = dataclasses.replace(base, widen=way)
        assert f"widen={way}" in t.label()
        np.testing.assert_array_equal(np.asarray(stacked_matmul(x, w, s, jnp.int32(2), t, True)), np.asarray(ref))
        got_g = stacked_gated(x, (w, s), (w[::-1], s[::-1]), jnp.int32(1), act, t, True)
        np.testing.assert_array_equal(np.asarray(got_g), np.asarray(ref_g))


def _int8_pools(B=2, H=8, K=2, hd=32, P=8, M=10):
    """(q, table, {name: (pool arrays, KeysFromValues or None, window)}) for the int8 kinds: global,
    sliding (a ring of blocks), keys rebuilt from values; pages of 8 over shuffled blocks."""
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.standard_normal((B, H, hd)), jnp.bfloat16)
    arrays, _ = paged_pools.pool(rng, L, B * M + 1, P, K, hd, int8=True)
    inv = (1.0 / 100.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    inv[hd // 8:] = 0.0                              # partial rotary, as Gemma 4's global layers
    keys = KeysFromValues(inv, jnp.asarray(rng.standard_normal(hd) * 0.3, jnp.bfloat16), 1e-6, 1.0)
    values = {n: arrays[n] for n in ("v", "v_scale")}
    return q, paged_pools.table(rng, B, M, B * M + 1), {
        "global": (arrays, None, None), "sliding": (arrays, None, 24), "keys from values": (values, keys, None)}


def test_decode_attention_identical():
    """Int8 K and V into bf16 dots (sliding), and values into float32 for the rebuilt keys (whose
    code path the global int8 pool shares, but for the window)."""
    q, table, pools = _int8_pools()
    pos = jnp.asarray([35, 69], jnp.int32)
    for name, ways in (("sliding", ("magic", "bits")), ("keys from values", ("bits",))):
        pool, keys, window = pools[name]
        run = functools.partial(decode_attention, q, pool, jnp.int32(1), table, pos, scale=0.2, block=16,
                                splits=2, window=window, keys=keys)
        ref = run(widen="convert")
        assert jnp.all(jnp.isfinite(ref.astype(jnp.float32))) and float(jnp.max(jnp.abs(ref))) > 0, name
        for way in ways:
            np.testing.assert_array_equal(np.asarray(run(widen=way)), np.asarray(ref), err_msg=f"{name} {way}")


@pytest.mark.parametrize("way", widening.WAYS)
def test_lowers_for_cuda(lower_for_cuda, way):
    """Each way's operations (integer widening, bit casts between int16 and bf16, bf16 arithmetic)
    are ones the Triton lowering takes, in the matmul and in every int8 attention kind (its tiles
    gathered from pages of 32 positions, tiles of 16 to 64: within a page and across pages)."""
    x, w, s = _matmul_inputs(M=16, K=256, N=128)
    t = Tiles(bm=16, bn=32, bk=64, out_major=True, widen=way)
    lowered = lower_for_cuda(lambda x, w, s: stacked_matmul(x, w, s, 1, t, True), x, w, s)
    assert "triton" in lowered.as_text().lower()
    q, table, pools = _int8_pools(hd=64, P=32, M=4)
    pos = jnp.asarray([35, 69], jnp.int32)
    for pool, keys, window in pools.values():
        for prefetch in (False, True):
            lower_for_cuda(lambda q, pool=pool: decode_attention(q, pool, 1, table, pos, scale=0.2, window=window,
                                                                 keys=keys, widen=way, prefetch=prefetch), q)
