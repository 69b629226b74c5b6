"""The Pallas decode kernels against the XLA formulation they replace, in Pallas interpret mode on
the CPU, over shapes with edge tiles: one row, odd widths, K not a multiple of the step; then whole
models, kernels forced on, against the XLA path, their KV in paged pools (the attention kernels
and the prologue alone: test_decode_attention.py, test_prefill_kernel.py)."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

import jaxllm
from jaxllm import RuntimeConfig, ops
from jaxllm.config.kv import KVOptions
from jaxllm.errors import ModelError
from jaxllm.ops import gpu as kernels
from jaxllm.ops.gpu import matmul
from jaxllm.ops.gpu.backend import PallasOps
from jaxllm.ops.gpu.matmul import Tiles, choose_tiles, stacked_gated, stacked_matmul, stacked_matmuls
from jaxllm.ops.gpu.types import layer_of, total, value
from jaxllm.ops.xla import XlaOps

L = 3
XLA = ops.select(RuntimeConfig(kernels="xla"))          # the reference
PALLAS = ops.select(RuntimeConfig(kernels="pallas"))    # the kernels, interpreted on a CPU


def _xla_linear(x, w, n_contract=1):
    """What XLA computes for a (possibly `Normed`) x against a layer of a `Stacked` weight: the
    layer sliced and contracted as it is laid out (output-major or not)."""
    return ops.xla.matmul(value(x), layer_of(w), n_contract, out_major=w.out_major)


def _w(rng, K, N, dtype):
    if dtype == "int8":
        return (jnp.asarray(rng.integers(-127, 128, (L, K, N)), jnp.int8),
                jnp.asarray(rng.random((L, N)) * 0.02 + 0.001, jnp.float32))
    return jnp.asarray(rng.standard_normal((L, K, N)) * 0.1, jnp.float32), None


def _ref(x, w, s, layer):
    y = x.astype(jnp.float32) @ w[layer].astype(jnp.float32)
    return y if s is None else y * s[layer]


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


TILES = [None, Tiles(bm=1, bn=16, bk=32, split=3), Tiles(bm=16, bn=32, bk=16, split=1),
         Tiles(bm=16, bn=16, bk=32, split=2), Tiles(bm=1, bn=16, bk=64, split=2, fold=16)]


def _om(w, out_major):
    """A [L, K, N] stack as the kernels take it: as is, or output-major [L, N, K]."""
    return jnp.swapaxes(w, 1, 2) if out_major else w


def _tiles(t, out_major):
    return None if t is None else dataclasses.replace(t, out_major=out_major)


@pytest.mark.parametrize("M,K,N", [(1, 100, 37), (3, 130, 70), (17, 64, 33), (1, 300, 129)])
@pytest.mark.parametrize("dtype", ["int8", "float32"])
@pytest.mark.parametrize("out_major", [False, True])
def test_stacked_matmul(M, K, N, dtype, out_major):
    rng = np.random.default_rng(M * K + N)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w, s = _w(rng, K, N, dtype)
    ref = _ref(x, w, s, 2)
    for t in TILES:
        if t is not None and t.bm == 1 and M > 1:
            t = Tiles(bm=1, bn=t.bn, bk=t.bk, split=t.split, fold=t.fold)   # a program per row
        got = stacked_matmul(x, _om(w, out_major), s, jnp.int32(2), _tiles(t, out_major), out_major)
        assert _rel(got, ref) < 1e-5, t


def test_weights_first_tiles():
    """Output-major tiles whose dot takes the weight tile as its left operand (the rows the other
    side), the choice above 128 rows: a plain, a K-split, a fused and an RMS-normed product and the
    gated one, each against the float32 product, rows past the last tile's end included."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((21, 96)), jnp.float32)
    w, s = _w(rng, 96, 40, "int8")
    u, su = _w(rng, 96, 40, "int8")
    for split in (1, 2):
        t = Tiles(bm=16, bn=16, bk=32, split=split, out_major=True, weights_first=True)
        assert _rel(stacked_matmul(x, _om(w, True), s, jnp.int32(2), t, True), _ref(x, w, s, 2)) < 1e-5
    t = Tiles(bm=16, bn=16, bk=32, out_major=True, weights_first=True)
    y, z = stacked_matmuls(x, [(_om(w, True), s), (_om(u, True), su)], jnp.int32(1), t, True)
    assert _rel(y, _ref(x, w, s, 1)) < 1e-5 and _rel(z, _ref(x, u, su, 1)) < 1e-5
    nw = jnp.asarray(rng.standard_normal((L, 96)), jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * nw[1]
    (y,) = stacked_matmuls(x, [(_om(w, True), s)], jnp.int32(1), t, True, norm=matmul.RowNorm(nw, jnp.int32(1), 1e-6))
    assert _rel(y, _ref(normed, w, s, 1)) < 1e-5
    g = stacked_gated(x, (_om(w, True), s), (_om(u, True), su), jnp.int32(0), jax.nn.silu, t, True)
    assert _rel(g, jax.nn.silu(_ref(x, w, s, 0)) * _ref(x, u, su, 0)) < 1e-5
    for gated in (False, True):
        assert choose_tiles(256, 2560, 6144, gated, out_major=True).weights_first
        assert not choose_tiles(128, 2560, 6144, gated, out_major=True).weights_first
        assert not choose_tiles(256, 2560, 6144, gated).weights_first


@pytest.mark.parametrize("out_major", [False, True])
def test_fused_projections_match_separate(out_major):
    """Q, K and V widths side by side in one grid; each output equals its own product."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 72)), jnp.float32)
    ws = [_w(rng, 72, n, "int8") for n in (48, 16, 17)]
    for t in (None, Tiles(bm=16, bn=16, bk=32, split=2), Tiles(bm=1, bn=16, bk=16, split=1)):
        outs = stacked_matmuls(x, [(_om(w, out_major), s) for w, s in ws], jnp.int32(1),
                               _tiles(t, out_major), out_major)
        for y, (w, s) in zip(outs, ws):
            assert y.shape == (2, w.shape[2])
            assert _rel(y, _ref(x, w, s, 1)) < 1e-5


@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("out_major", [False, True])
def test_stacked_gated(M, split, out_major):
    """Default tiles (40 rows, output-major: two 32-row blocks, the second partly filled, unsplit)
    and explicit ones, against the float32 product."""
    rng = np.random.default_rng(M + 10 * split)
    x = jnp.asarray(rng.standard_normal((M, 90)), jnp.float32)
    g, u = _w(rng, 90, 45, "int8"), _w(rng, 90, 45, "int8")
    act = lambda v: jax.nn.gelu(v, approximate=True)             # noqa: E731
    ref = act(_ref(x, *g, 0)) * _ref(x, *u, 0)
    t = Tiles(bm=1 if M == 1 else 16, bn=16, bk=32, split=split)
    gm, um = (_om(g[0], out_major), g[1]), (_om(u[0], out_major), u[1])
    for tiles in (None, t):
        got = stacked_gated(x, gm, um, jnp.int32(0), act, _tiles(tiles, out_major), out_major)
        assert _rel(got, ref) < 1e-5
    if M == 40 and out_major:
        default = choose_tiles(M, 90, 45, True, out_major=True)
        assert (default.bm, default.bn, default.split) == (32, 64, 1)


def test_out_major_weights_on_the_xla_path():
    """Output-major stacks (how the kernels' weights are laid out) contracted by XLA wherever the
    kernels do not run: a prefill's many rows, and XLA's own contraction of them; the XLA backend
    leaves the weights as they are (`prepare_weights`), the kernels' lays them out output-major."""
    from jaxllm.model.params import NORM, ParamSpec, matmul_weight, stack
    from jaxllm.ops.gpu.types import OutMajor, Stacked
    from jaxllm.ops.gpu.weights import out_major
    from jaxllm.quant import QuantArray
    rng = np.random.default_rng(7)
    w, s = _w(rng, 2 * 12, 20, "int8")
    o = QuantArray(w.reshape(L, 2, 12, 20), s, 2)                # an O projection: heads, head_dim
    weights = {"layers": {"g": {"o": o, "attn_norm": jnp.ones((L, 20))}}}
    axes = ("q_heads", "head_dim", "embed")
    specs = {"layers": {"g": {"o": stack(matmul_weight((2, 12, 20), axes, 2), L),
                              "attn_norm": stack(ParamSpec((20,), ("embed",), role=NORM), L)}}}
    assert XLA.prepare_weights(weights, specs) is weights
    for om in (PALLAS.prepare_weights(weights, specs)["layers"]["g"]["o"], out_major(weights, specs)["layers"]["g"]["o"]):
        assert isinstance(om, OutMajor) and om.w.q.shape == (L, 20, 2, 12) and om.n_contract == 2
    got = PALLAS.layer_weights(PALLAS.prepare_weights(weights, specs)["layers"]["g"], jnp.int32(1), specs["layers"]["g"])
    assert got["o"].axes == axes and got["o"].out_major and got["attn_norm"].axes is None
    assert weights["layers"]["g"]["o"] is o                      # not donated: the input stays
    for rows in (3, 300):                                        # kernel, then XLA (> 256 rows)
        x = jnp.asarray(rng.standard_normal((rows, 2, 12)), jnp.float32)
        ref = _ref(x.reshape(rows, 24), w, s, 1)
        for mode in ("pallas", "xla"):
            stacked = Stacked(om.w, jnp.int32(1), axes, out_major=True)
            y = PALLAS.linear(x, stacked, 2) if mode == "pallas" else _xla_linear(x, stacked, 2)
            assert _rel(y, ref) < 1e-5, (rows, mode)
        # in bf16, above 256 rows the scale is folded into the widened weight and the GEMM writes
        # bf16: within bf16 rounding of the float32 product, input-major and output-major alike
        xb = x.astype(jnp.bfloat16)
        refb = _ref(xb.astype(jnp.float32).reshape(rows, 24), w, s, 1)
        for stacked in (Stacked(om.w, jnp.int32(1), axes, out_major=True), Stacked(o, jnp.int32(1), axes)):
            y = PALLAS.linear(xb, stacked, 2)
            assert y.dtype == jnp.bfloat16 and _rel(y.astype(jnp.float32), refb) < 1e-2, (rows, stacked.out_major)
        # the layer as the XLA backend holds it (input-major), through its own `linear`
        y = XLA.linear(x, XLA.layer_weights(weights["layers"]["g"], jnp.int32(1), specs["layers"]["g"])["o"], 2)
        assert _rel(y, ref) < 1e-5, (rows, "xla backend")


def test_tile_choice_fits_and_fills():
    for M, K, N, gated, wb in [(1, 2560, 6144, False, 1), (1, 2560, 9728, True, 1), (8, 9728, 2560, False, 2),
                               (64, 2560, 9728, True, 2), (256, 5376, 21504, True, 1)]:
        t = choose_tiles(M, K, N, gated, wb)
        smem = t.stages * t.bk * (t.bm * 2 + (2 if gated else 1) * t.bn * wb)
        assert smem <= 200 * 1024 and t.split >= 1 and t.bk <= K
        blocks = -(-M // t.bm) * -(-N // t.bn) * t.split
        assert blocks >= 132 or t.split == (4 if gated or M > 1 else 16), (M, K, N, t)
    # Batch 1, output-major: a fused Q/K/V wide enough to cover the GPU twice is not split (each
    # output's partial sum would be a kernel); a single output of the same width is (its sum fuses).
    assert choose_tiles(1, 2560, 6144, out_major=True, outputs=3).split == 1
    # Batch 1, output-major: each thread folds its 16 contiguous inputs every step
    assert choose_tiles(1, 2560, 9728, True, out_major=True).fold == 16
    assert choose_tiles(1, 21504, 5376, out_major=True).split > 1
    # ... unless it is a row-parallel shard, all-reduced next (its partials' sum would be a kernel
    # of its own): then narrower blocks, unsplit, where they cover the GPU twice
    t = choose_tiles(1, 21504 // 4, 5376, out_major=True, psum_after=True)
    assert (t.bn, t.split) == (8, 1)
    assert choose_tiles(1, 2560, 1024, out_major=True, psum_after=True).split > 1
    # 8 rows: a gated product is not split (its partials' sum would be an XLA kernel); others are
    assert choose_tiles(8, 2560, 9728, True, out_major=True).split == 1
    assert choose_tiles(8, 2560, 6144, out_major=True, outputs=3).split > 1
    # ... in blocks of 64 channels, or 32 where an output is too narrow for 64 to fill the GPU
    assert [choose_tiles(8, K, N, out_major=True).bn for K, N in ((2560, 6144), (9728, 2560))] == [64, 32]
    assert choose_tiles(8, 2560, 9728, True, out_major=True).bn == 32


def test_batch1_gated_warps_per_gpu(monkeypatch):
    """The batch-1 gated product and projections in tiles of 32-64 rows run 4 warps a block on an
    H200, 8 elsewhere; 16-row tiles take 4 everywhere, and so do the gated product above 16 rows,
    in 32-row tiles of 64 channels, unsplit, and projections of 17-32 rows, in 64 channels."""
    for kind, warps in (("NVIDIA H200", 4), ("NVIDIA H100 80GB HBM3", 8)):
        monkeypatch.setattr(matmul, "device_kind", lambda kind=kind: kind)
        assert choose_tiles(1, 5376, 10752, True, out_major=True).warps == warps
        assert choose_tiles(1, 5376, 10752, out_major=True).warps == 8
        assert choose_tiles(8, 5376, 10752, True, out_major=True).warps == 4
        for M in (24, 64, 100):
            t = choose_tiles(M, 5376, 10752, True, out_major=True)
            assert (t.bm, t.bn, t.warps, t.split) == (32, 64, 4, 1), (kind, M, t)
            t = choose_tiles(M, 2560, 2560, out_major=True)
            assert (t.bn, t.warps) == ((64, 4) if M <= 32 else (128, warps)) and t.split > 1, (kind, M, t)


@pytest.mark.parametrize("split,post,dtype", [(0, False, "float32"), (2, True, "float32"),
                                              (3, False, "float32"), (0, True, "bfloat16")])
def test_residual_norm(split, post, dtype):
    """x + rms_norm(y, post) and its rms_norm with `pre` in one kernel, y as an array or as a
    matmul's unsummed float32 partials with their per-channel scales; norm weights and scales read
    in their layer stacks; D = 80 (not a power of two). Against the XLA path of `add_norm`."""
    from jaxllm.ops.gpu.types import Partials, Stacked
    rng = np.random.default_rng(8)
    M, D, L = 3, 80, 2
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((M, D)), dt)
    if split:
        y = Partials(jnp.asarray(rng.standard_normal((split, M, D)), jnp.float32),
                     Stacked(jnp.asarray(rng.uniform(0.5, 1.5, (L, D)), jnp.float32), jnp.int32(1)), dt)
    else:
        y = jnp.asarray(rng.standard_normal((M, D)), dt)
    pw, qw = (Stacked(jnp.asarray(rng.standard_normal((L, D)) * 0.3, dt), jnp.int32(1)) for _ in range(2))
    got = {"xla": XLA.add_norm(x, total(y), layer_of(pw) if post else None, layer_of(qw), 1e-6, 1.0),
           "pallas": PALLAS.add_norm(x, y, pw if post else None, qw, 1e-6, 1.0)}
    tol = 1e-6 if dtype == "float32" else 1e-2
    for a, b in zip(got["pallas"], got["xla"]):
        assert a.dtype == dt and _rel(a, b) < tol
    # In a jitted step the outputs may take over x's buffer and a spent one's (`h_into`): the same
    # values, and the caller's arrays are left as they were.
    x0, spent = np.asarray(x), jnp.zeros_like(x)
    step = jax.jit(lambda x, h: PALLAS.close_layer(x, y, pw if post else None, qw, 1e-6, 1.0, h_into=h))
    for a, b in zip(step(x, spent), got["pallas"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(x), x0)


def test_matmul_partials_sum_to_the_product():
    """`linear(..., partials=True)` hands over a K-split product unsummed; summed it is the product."""
    from jaxllm.ops.gpu.types import Partials, Stacked
    from jaxllm.quant import QuantArray
    rng = np.random.default_rng(9)
    w, s = _w(rng, 1024, 40, "int8")
    x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.float32)
    wq = Stacked(QuantArray(w, s), jnp.int32(1), ("mlp", "embed"))
    p, y = PALLAS.linear(x, wq, 1, partials=True), PALLAS.linear(x, wq, 1)
    assert isinstance(p, Partials) and p.parts.shape[0] > 1
    assert _rel(p.total(), y) < 1e-6 and _rel(y, _ref(x, w, s, 1)) < 1e-5


@pytest.mark.parametrize("M,dtype,weight,offset,split", [
    (1, "float32", True, 0.0, 1), (1, "bfloat16", True, 1.0, 2), (3, "float32", False, 0.0, 1),
    (17, "bfloat16", True, 1.0, 2)])
def test_matmul_normalizes_its_input_rows(M, dtype, weight, offset, split):
    """A `Normed` input: the Q/K/V kernel applies the RMSNorm to x's rows as it loads them (K=100:
    the last tile partly filled; the weight read in its layer stack, or no weight), against
    rms_norm and then the products on the XLA path."""
    from jaxllm.ops.gpu.types import Normed, Stacked
    from jaxllm.quant import QuantArray
    rng = np.random.default_rng(M + split)
    K, dt = 100, jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((M, K)) * 3, dt)
    nw = Stacked(jnp.asarray(rng.standard_normal((L, K)) * 0.3, dt), jnp.int32(1)) if weight else None
    ws = [_w(rng, K, n, "int8") for n in (48, 16)]
    tiles = Tiles(bm=1 if M == 1 else 16, bn=16, bk=32, split=split, out_major=True,
                  fold=16 if M == 1 else 0)
    stacks = [Stacked(QuantArray(_om(w, True), s, 1), jnp.int32(2), ("embed", heads, "head_dim"), out_major=True)
              for (w, s), heads in zip(ws, ("q_heads", "kv_heads"))]
    tol = 1e-5 if dtype == "float32" else 2e-2
    got = {"pallas": PALLAS.linears(Normed(x, nw, 1e-6, offset), stacks),
           "xla": [_xla_linear(Normed(x, nw, 1e-6, offset), w) for w in stacks]}
    chosen = {(s["shape"][2], s["choice"]) for s in kernels.selections()
              if s["kernel"] == "matmul" and s["shape"][:2] == [M, K]}
    fused = [c for n, c in chosen if n == "48+16"]     # one launch, normalizing one row itself
    assert len(fused) == 1 and fused[0].endswith("rms-norm") == (M == 1)
    one = PALLAS.linear(Normed(x, nw, 1e-6, offset), stacks[0])     # a layer reading another's KV: Q alone
    assert _rel(one, got["xla"][0]) < tol
    assert any(s["kernel"] == "matmul" and s["shape"][:3] == [M, K, "48"] for s in kernels.selections())
    from jaxllm.ops.gpu.matmul import RowNorm, stacked_matmuls
    direct = stacked_matmuls(x, [(_om(w, True), s) for w, s in ws], jnp.int32(2), tiles, True,
                             norm=RowNorm(None if nw is None else nw.stack, 1, 1e-6, offset))
    for a, b, c in zip(got["pallas"], got["xla"], direct):
        assert a.dtype == dt and _rel(a, b) < tol and _rel(c, b) < tol
    assert any(s["choice"].endswith("rms-norm") for s in kernels.selections())


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("tied,dtype", [(True, "int8"), (False, "int8"), (True, "float32")])
def test_output_head(M, tied, dtype):
    """The logits by the matmul kernel, against every row of a tied embedding table [V, D] with a
    scale per row, or through an untied lm_head [D, V]; float32 out, an odd vocabulary. The kernel
    backend's head runs it; the XLA backend's gives the same logits by XLA."""
    from jaxllm.ops.gpu.dispatch import output_head
    from jaxllm.quant import QuantArray
    rng = np.random.default_rng(M + 2 * tied)
    D, V = 48, 101
    h = jnp.asarray(rng.standard_normal((M, 1, D)), jnp.float32)
    w, s = _w(rng, D, V, dtype)                           # [L, D, V], [L, V]
    ref = _ref(h[:, 0], w, s, 0)
    q = w[0].T if tied else w[0]
    table = q if s is None else QuantArray(q, s[0][:, None] if tied else s[0], 1)
    with kernels.scope():
        got = output_head(h, table, tied)
    assert got.shape == (M, 1, V) and got.dtype == jnp.float32
    assert _rel(got[:, 0], ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(PALLAS.output_head(h, table, tied)), np.asarray(got))
    assert not isinstance(XLA, PallasOps)
    want = ops.xla.matmul_rows(h, table) if tied else ops.xla.matmul(h, table).astype(jnp.float32)
    y = XLA.output_head(h, table, tied)
    assert y.shape == (M, 1, V) and y.dtype == jnp.float32 and _rel(y[:, 0], ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_kernel_mode_switch(monkeypatch):
    assert not ops.uses_kernels(RuntimeConfig(kernels="xla"))
    assert type(ops.select(RuntimeConfig(kernels="xla"))) is XlaOps
    assert ops.select(RuntimeConfig(kernels="xla")).name == "xla"
    assert ops.uses_kernels(RuntimeConfig(kernels="pallas"))
    assert isinstance(ops.select(RuntimeConfig(kernels="pallas")), PallasOps)
    assert ops.select(RuntimeConfig(kernels="pallas")).name == "pallas"
    on_gpu = jax.default_backend() == "gpu"
    assert ops.uses_kernels(RuntimeConfig(kernels="auto")) == on_gpu     # the kernels on GPUs, XLA elsewhere
    assert ops.uses_kernels(RuntimeConfig()) == on_gpu
    assert isinstance(ops.select(RuntimeConfig()), PallasOps) == on_gpu
    with pytest.raises(ModelError, match="kernels must be one of auto, xla, pallas, got 'triton'"):
        RuntimeConfig(kernels="triton")
    # the environment, read at the edge (`RuntimeConfig.from_env`)
    for raw, want in (("xla", "xla"), (" Pallas ", "pallas"), ("", "auto")):
        monkeypatch.setenv("JAXLLM_KERNELS", raw)
        assert RuntimeConfig.from_env().kernels == want
    monkeypatch.setenv("JAXLLM_KERNELS", "triton")
    with pytest.raises(ModelError, match="JAXLLM_KERNELS.*kernels must be one of"):
        RuntimeConfig.from_env()


def test_gpu_compiles_take_cublas_gemms(monkeypatch):
    """On GPUs the engine's calls compile without XLA's autotuned Triton GEMMs unless the runtime
    asks for them (`JAXLLM_TRITON_GEMM=on`); elsewhere no option is passed."""
    class OnGpu(XlaOps):
        platform = "gpu"
    assert OnGpu().compiler_options() == {"xla_gpu_enable_triton_gemm": False}
    assert OnGpu(RuntimeConfig(triton_gemm=True)).compiler_options() == {}
    assert XlaOps().compiler_options() == {} and PALLAS.compiler_options() == {}
    for raw, want in (("on", True), ("1", True), (" Off ", False), ("", False)):
        monkeypatch.setenv("JAXLLM_TRITON_GEMM", raw)
        assert RuntimeConfig.from_env().triton_gemm is want
    monkeypatch.setenv("JAXLLM_TRITON_GEMM", "maybe")
    with pytest.raises(ModelError, match="JAXLLM_TRITON_GEMM: triton_gemm must be on or off, got 'maybe'"):
        RuntimeConfig.from_env()


def test_widen_once_where_the_copy_fits(monkeypatch):
    """Above the kernels' rows a decode call's int8 weights are widened once before its loop (the
    same values), where the copy fits beside the weights, the call's state and a tenth of the
    device; `on` and `off` override that, and the XLA backend leaves them as they are."""
    from jaxllm.ops.gpu import backend, dispatch
    from jaxllm.quant import QuantArray
    q = jnp.asarray(np.random.default_rng(0).integers(-127, 128, (2, 8, 6)), jnp.int8)
    weights = {"w": QuantArray(q, jnp.ones((2, 6), jnp.float32)), "norm": jnp.ones((8,), jnp.float32)}
    state = {"cache": jnp.zeros((1000,), jnp.float32)}          # 4000 bytes
    rows = dispatch.MAX_ROWS + 1

    def loop(limit, mode="auto", rows=rows, ops_=None):
        monkeypatch.setattr(backend, "_bytes_limit", lambda layout: limit)
        o = ops_ or ops.select(RuntimeConfig(kernels="pallas", widen_once=mode))
        return o.loop_weights(weights, rows, state, jnp.bfloat16)
    # 96 int8 values: a 192-byte copy beside 4176 bytes of weights (96 + 48 + 32) and state (4000)
    got = loop(10_000)
    assert got["w"].q.dtype == jnp.bfloat16 and got["w"].scale is weights["w"].scale
    np.testing.assert_array_equal(np.asarray(got["w"].q, np.float32), np.asarray(q, np.float32))
    assert got["norm"] is weights["norm"]
    assert {s["choice"] for s in kernels.selections() if s["kernel"] == "widen once"} >= {"on"}
    assert loop(4_600)["w"].q.dtype == jnp.int8                  # 4176 + 192 + 460 > 4600
    assert loop(None)["w"].q.dtype == jnp.int8                   # no limit known (a CPU)
    assert loop(10_000, rows=dispatch.MAX_ROWS)["w"].q.dtype == jnp.int8      # the kernels' rows
    assert loop(None, "on")["w"].q.dtype == jnp.bfloat16
    assert loop(10_000, "off")["w"].q.dtype == jnp.int8
    assert loop(10_000, ops_=XLA)["w"].q.dtype == jnp.int8
    for raw, want in (("on", "on"), (" OFF ", "off"), ("", "auto")):
        monkeypatch.setenv("JAXLLM_WIDEN_ONCE", raw)
        assert RuntimeConfig.from_env().widen_once == want
    monkeypatch.setenv("JAXLLM_WIDEN_ONCE", "maybe")
    with pytest.raises(ModelError, match="JAXLLM_WIDEN_ONCE: widen_once must be one of auto, on, off, got 'maybe'"):
        RuntimeConfig.from_env()


def test_decode_with_weights_widened_once_equals_the_plain_path(tmp_path, monkeypatch):
    """A whole int8 model whose decode steps take more rows than the kernels (their limit lowered
    to 1 row): the weights widened once a call give the tokens of the weights widened in each step."""
    from jaxllm.ops.gpu import dispatch
    monkeypatch.setattr(dispatch, "MAX_ROWS", 1)
    tiny.make("qwen3", tmp_path, seed=7)
    prompts = [[5, 9, 2, 7], [11, 3], [4, 4, 8]]
    got = {}
    for mode in ("off", "on"):
        eng = jaxllm.load(str(tmp_path), quant="int8", dtype="float32", max_ctx=32,
                          runtime=RuntimeConfig(kernels="pallas", widen_once=mode))
        got[mode] = [c.token_ids for c in eng.generate_ids(prompts, max_tokens=8)]
    assert got["on"] == got["off"] and all(len(t) == 8 for t in got["on"])
    assert any(s["kernel"] == "widen once" and s["choice"] == "on" and s["shape"][0] == 3
               for s in kernels.selections())


def test_kernel_traced_and_lowered_once(lower_for_cuda, monkeypatch):
    """Two programs holding the same kernel (as a server's decode blocks with and without
    log-probabilities do) share its trace and its Triton module; another shape is another kernel."""
    from jax._src.pallas.triton import lowering as tl

    from jaxllm.ops.gpu import lowered
    assert lowered.install() and tl.lower_jaxpr_to_triton_module._jaxllm_kept
    made, orig = [], lowered._original
    monkeypatch.setattr(lowered, "_modules", {})
    monkeypatch.setattr(lowered, "_original", lambda *a, **k: made.append(a[0]) or orig(*a, **k))
    x, w, s = _matmul_inputs_int8(M=8, K=192, N=96)
    t = Tiles(bm=16, bn=32, bk=64, out_major=True)
    texts = [lower_for_cuda(f, x, w, s).as_text() for f in (
        lambda x, w, s: stacked_matmul(x, w, s, 1, t, True),
        lambda x, w, s: stacked_matmul(x, w, s, 2, t, True) * 2 + stacked_matmul(x, w, s, 0, t, True))]
    assert len(made) == 1 and all(text.count("xla.gpu.triton") == 1 for text in texts)
    lower_for_cuda(lambda x, w, s: stacked_matmul(x, w, s, 1, t, True), x[:4], w, s)
    assert len(made) == 2


def _matmul_inputs_int8(M, K, N):
    rng = np.random.default_rng(5)
    return (jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16),
            jnp.asarray(rng.integers(-128, 128, (L, N, K)), jnp.int8),
            jnp.asarray(rng.random((L, N)) * 0.02 + 0.001, jnp.float32))


def _run(eng, prompts, ids):
    out = [c.token_ids for c in eng.generate_ids(prompts, max_tokens=10)]
    out += [c.token_ids for c in eng.generate_ids(prompts[:1], max_tokens=4)]     # one row
    stepper, logits = eng.core(2, 32), []
    for t in range(ids.shape[1]):
        lg = stepper.step_logits(ids[:, t], np.full(2, t))
        logits.append(np.asarray(lg))
    return out, np.stack(logits)


@pytest.mark.parametrize("family,quant,kv", [("gemma3", "int8", "none"), ("qwen3", "int8", "int8"),
                                            ("gemma3", "int8", "int8-rings")])
def test_model_kernels_match_xla(family, quant, kv, tmp_path, monkeypatch):
    """Whole models with every kernel forced on: the same greedy tokens as the XLA path past several
    wraps of Gemma 3's sliding window (8), and step logits within float32 rounding past one. The
    pools in pages of 8 positions, so every kernel's tiles span several pages, and the sliding
    layers' tables are rings of a few blocks. With kv="int8" the global layers in int8
    ("int8-rings": the sliding ones too). (Unquantized weights through the kernels: the sharded
    test's Qwen3 cases.)"""
    tiny.make(family, tmp_path, seed=3)
    if kv == "int8":          # every matmul split over K, as larger models are: partials downstream
        orig = matmul.choose_tiles

        def split_tiles(M, K, N, *a, **kw):
            t = orig(M, K, N, *a, **kw)
            return dataclasses.replace(t, bk=16, split=max(1, min(4, K // 32)), fold=16 if t.fold else 0)
        monkeypatch.setattr(matmul, "choose_tiles", split_tiles)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 160, n).tolist() for n in (5, 12, 9)]
    ids = rng.integers(0, 160, (2, 11)).astype(np.int32)
    options = KVOptions(block_size=8, int8_rings=kv.endswith("rings"))
    results = {}
    for mode in ("xla", "pallas"):
        eng = jaxllm.load(str(tmp_path), quant=quant, dtype="float32", max_ctx=64, kv_quant=kv[:4],
                          kv_options=options, runtime=RuntimeConfig(kernels=mode))
        assert eng.runtime.kernels == mode and eng.ops.name == mode
        results[mode] = _run(eng, prompts, ids)
    assert results["xla"][0] == results["pallas"][0]
    assert tiny.rel_err(results["pallas"][1], results["xla"][1]) < 1e-5
    chosen = {s["kernel"] for s in kernels.selections()}
    assert {"matmul", "gated matmul", "decode attention", "prefill attention", "output head"} <= chosen
    assert any(s["choice"].endswith("out-major") for s in kernels.selections())   # as loaded for them
    assert any(s["choice"].endswith("rms-norm") for s in kernels.selections())    # the input norm
    pools = {(s["shape"][-2], s["shape"][-1]) for s in kernels.selections()
             if s["kernel"] == "decode attention" and "page=8" in s["choice"]}
    assert ("int8" if kv != "none" else "float32", "global") in pools
    if family == "gemma3":
        assert ("int8" if kv == "int8-rings" else "float32", "sliding") in pools
    if kv == "int8":                    # several rows' Q/K/V partials summed in the prologue
        assert any(" partials" in s["choice"] for s in kernels.selections()
                   if s["kernel"] == "decode prologue")


def test_sharded_kernels_match_single_device_xla(tmp_path):
    """TP=4 over 4 host devices with the kernels forced on (each device runs them on its shards
    inside shard_map) against one device on the XLA path: logits, step logits and greedy tokens."""
    import json
    import subprocess
    import sys
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(here)), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, os.path.join(here, "sharded_kernels_run.py"), str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for case, res in out.items():
        if case == "selections":
            continue
        assert res["greedy_equal"], case
        assert res["forward_err"] < 2e-5 and res["step_err"] < 2e-5, (case, res)
    used = {(s["kernel"], s["choice"].split()[0]) for s in out["selections"]}
    assert ("decode attention", "pallas") in used and ("matmul", "pallas") in used
    assert ("output head", "pallas") in used            # each device its vocabulary rows
    assert ("decode attention", "xla") in used          # 2 KV heads cannot follow 4-way split heads
    assert any(s["choice"].endswith("out-major") for s in out["selections"] if s["kernel"] == "matmul")
    split_kinds = {s["shape"][-1] for s in out["selections"]
                   if s["kernel"] == "decode attention" and s["choice"].startswith("pallas")}
    assert "global keys-from-values" in split_kinds         # Gemma 4's int8 global layers, V alone
