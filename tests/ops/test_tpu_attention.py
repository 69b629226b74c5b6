"""The TPU's ragged paged attention kernel (`ops.tpu`) against XLA's attention over the same paged
pool (`LayerKV.attend` with `XlaOps`), run by Pallas's TPU interpreter on the CPU (which simulates
its DMAs, semaphores and scalar prefetch, and fills memory nothing wrote with NaNs): block tables
shuffled, blocks partly written, rows of padding and rows right-padded, decode (one token a row),
prefill chunks continued at an offset and over several query tiles, sliding windows over narrow
tables whose columns wrap, int8 pools with their scales, soft-capping, float32 and bfloat16, both
orders a device keeps a pool's blocks in; then the backend (`TpuOps`) on one device, its fallback
to XLA, and per device under tensor parallelism (heads split over two devices, or one KV head on
both)."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxllm.config.runtime import RuntimeConfig
from jaxllm.kv.blockwise import quantize_kv
from jaxllm.kv.paged import KVPool, LayerKV
from jaxllm.ops import tpu
from jaxllm.ops.tpu.attention import Pages, paged_attention, work_items
from jaxllm.ops.tpu.backend import TpuOps
from jaxllm.ops.xla import KeysFromValues, XlaOps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L, SCALE = 2, 0.125
INTERPRET = pltpu.InterpretParams()


def make_case(B, T, H, K, hd, P, M, starts, lengths=None, int8=False, dtype=jnp.float32, seed=0):
    """(q, layer view, positions): a pool of random blocks (row tables drawn from it shuffled, so
    rows interleave), row b's tokens at starts[b].. for lengths[b] of them (-1 after; a negative
    start: a row of padding)."""
    rng = np.random.default_rng(seed)
    N = B * M + 3
    k, v = (jnp.asarray(rng.standard_normal((L, N, P, K, hd)), jnp.float32) for _ in range(2))
    if int8:
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        pool = KVPool(kq, vq, ks, vs, read=P * M)
    else:
        pool = KVPool(k.astype(dtype), v.astype(dtype), read=P * M)
    table = jnp.asarray(rng.permutation(np.arange(1, N))[:B * M].reshape(B, M), jnp.int32)
    lengths = np.full(B, T) if lengths is None else np.asarray(lengths)
    starts = np.asarray(starts)[:, None]
    t = np.arange(T)[None, :]
    pos = np.where((starts >= 0) & (t < lengths[:, None]), starts + t, -1)
    q = jnp.asarray(rng.standard_normal((B, T, H, hd)), dtype)
    return q, LayerKV(pool, jnp.int32(1), table), jnp.asarray(pos, jnp.int32)


def reference(q, view, pos, window, softcap):
    return view.attend(q, pos, XlaOps(), scale=SCALE, softcap=softcap, window=window)


def pages_of(view, heads_major: bool) -> Pages:
    p = view.pool
    order = (lambda x: jnp.swapaxes(x, 2, 3)) if heads_major else (lambda x: x)
    return Pages(order(p.k), order(p.v), p.k_scale, p.v_scale, heads_major)


def close(out, ref, dtype):
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    assert err < (2e-2 if dtype == jnp.bfloat16 else 2e-5), err


@pytest.mark.parametrize("B,T,H,K,P,M,starts,lengths,window,softcap,int8,dtype,heads_major", [
    # decode over shuffled tables: a row of padding, partly written last blocks, 2 query heads a KV head
    (3, 1, 4, 2, 16, 6, [37, -1, 90], None, None, None, False, jnp.float32, False),
    # decode over a ring of 3 blocks of a 24-position window, rows far past the table's width
    (2, 1, 4, 1, 16, 3, [101, 58], None, 24, 20.0, True, jnp.float32, True),
    # prefill chunks continued at an offset, one right-padded: 80 tokens x 4 heads make 2 query tiles
    (2, 80, 4, 1, 16, 8, [40, 0], [80, 51], None, None, False, jnp.bfloat16, False),
    # a chunk over a wrapping ring: the window's first block, then blocks reused by the chunk itself
    (2, 6, 4, 2, 16, 3, [70, 13], [6, 4], 20, 5.0, True, jnp.float32, False),
])
def test_kernel_matches_xla(B, T, H, K, P, M, starts, lengths, window, softcap, int8, dtype, heads_major):
    q, view, pos = make_case(B, T, H, K, 128, P, M, starts, lengths, int8, dtype)
    out = paged_attention(q, pages_of(view, heads_major), view.idx, view.table, pos, scale=SCALE,
                          softcap=softcap, window=window, interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    close(out, reference(q, view, pos, window, softcap), dtype)
    assert not jnp.any(out[pos < 0])                       # padding queries see nothing


def test_work_items_read_only_visible_blocks():
    """Each query tile reads from its window's first block to its last query's block."""
    pos = jnp.asarray([[70, 71, 72, 73], [-1, -1, -1, -1], [5, 6, -1, -1]], jnp.int32)
    first, count = work_items(pos, 2, 16, window=20)
    # row 0: tile (70, 71) from position 51 (block 3) to block 4; tile (72, 73) from 53 (block 3)
    assert first.tolist() == [3, 3, 0, 0, 0, 0] and count.tolist() == [2, 2, 0, 0, 1, 0]
    first, count = work_items(pos, 4, 16, window=None)
    assert first.tolist() == [0, 0, 0] and count.tolist() == [5, 0, 1]


def test_backend_takes_the_pool_and_falls_back_where_it_cannot():
    ops = TpuOps(RuntimeConfig(), interpret=INTERPRET)
    assert ops.name == "tpu" and ops.kv_dtype(jnp.bfloat16) == jnp.bfloat16
    q, view, pos = make_case(2, 3, 4, 2, 128, 16, 4, [20, 9], [3, 1])
    out = view.attend(q, pos, ops, scale=SCALE, softcap=None, window=None)
    close(out, reference(q, view, pos, None, None), jnp.float32)
    # a pool of values alone (keys rebuilt from them) and a head width off the lanes: XLA's loop
    values = view.replace(pool=view.pool.replace(k=None))
    keys = KeysFromValues(np.ones(64, np.float32), None)
    assert ops.paged_attention(q, values, pos, scale=SCALE, softcap=None, window=None, keys=keys) is None
    q64, view64, pos64 = make_case(1, 1, 2, 1, 64, 16, 2, [3])
    assert ops.paged_attention(q64, view64, pos64, scale=SCALE, softcap=None, window=None) is None
    chosen = {(s["shape"][4], s["choice"]) for s in tpu.selections() if s["kernel"] == "paged attention"}
    assert {(128, "kernel"), (128, "xla (keys rebuilt from values)"),
            (64, "xla (head_dim 64 not a multiple of 128)")} <= chosen


SHARDED = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp
from jaxllm.config.axes import cache_leaf_axes
from jaxllm.config.runtime import RuntimeConfig
from jaxllm.model.sharding import layout_for
from jaxllm.ops import tpu
from jaxllm.ops.tpu.backend import TpuOps
from test_tpu_attention import SCALE, make_case, reference
layout = layout_for(2)
# JAX's plain interpreter: the TPU interpreter's state for several devices keeps the process
# from exiting once the kernel ran (jax 0.10.2)
ops = TpuOps(RuntimeConfig(), layout, interpret=True)
out = {}
for name, (H, K) in {"heads split": (4, 2), "one KV head on both": (4, 1)}.items():
    q, view, pos = make_case(2, 3, H, K, 128, 16, 4, [20, 45], [3, 2], int8=K == 1)
    pool = jax.tree_util.tree_map(lambda a: jax.device_put(a, layout.sharding(a.shape, cache_leaf_axes(a.ndim))),
                                  view.pool)
    sharded = view.replace(pool=pool)
    q = jax.device_put(q, layout.sharding(q.shape, ("batch", "seq", "q_heads", "head_dim")))
    o = jax.jit(lambda q, v, p: v.attend(q, p, ops, scale=SCALE, softcap=None, window=24))(q, sharded, pos)
    ref = reference(q, view, pos, 24, None)
    out[name] = float(jnp.max(jnp.abs(o - ref)))
out["choices"] = sorted({s["choice"] for s in tpu.selections()})
print(json.dumps(out))
"""


def test_backend_per_device_under_tensor_parallelism():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.dirname(__file__)])}
    r = subprocess.run([sys.executable, "-c", SHARDED, os.path.dirname(__file__)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out.pop("choices") == ["kernel"]
    for name, err in out.items():
        assert err < 2e-5, (name, err)
