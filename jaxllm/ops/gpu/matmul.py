"""Small-M matmuls that read one layer's weight straight out of the layer-stacked array.

Inside the layer scan, XLA slices each layer's weight out of its `[layers, K, N]` stack before the
dot, and for int8 weights it widens the slice to bf16 on the way: every weight byte is read, written
twice as wide and read again. These kernels take the whole stack and the layer index instead, load
int8 (or bf16) tiles of that layer, widen them in registers, and apply the per-output-channel scale
in the epilogue. Decode is memory-bound, so the tiling is chosen to put enough blocks on the GPU
(split over K when the output is narrow) rather than for arithmetic reuse: a table per GPU kind
(`matmul_tiles`), which `choose_tiles` completes for the shape.

A stack is read either as the model holds it, input-major `[L, K, N]`, or output-major `[L, N, K]`
(`Tiles.out_major`; see `kernels.weights`), where each output channel's inputs are contiguous, so a
batch-1 tile is rows of 256 contiguous bytes rather than 64: on an H100 the Q/K/V, O and down
projections streamed 1.2-1.3x faster inside the decode step that way.

    stacked_matmul(x [M, K], w [L, K, N] or [L, N, K], scale [L, N] | None, layer) -> [M, N]
    stacked_gated(x, (w_gate, s_gate), (w_up, s_up), layer, act) -> act(x @ gate) * (x @ up)

The second is a gated MLP's input half in one pass over x: both weights' tiles of a column block
are read by the same program and only the gated product is written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.ops.gpu import device_kind, note, pallas_call
from jaxllm.ops.gpu import widen as widening
from jaxllm.ops.gpu.matmul_tiles import Entry, entries


@dataclass(frozen=True)
class Tiles:
    bm: int  # rows per block; 1 = a vector product reduced in registers, else tensor-core dots
    bn: int  # output columns per block
    bk: int  # contraction step
    split: int = 1  # blocks along K, each writing a float32 partial that XLA sums
    warps: int = 4
    stages: int = 3
    out_major: bool = False  # the weight stack is [L, N, K] rather than [L, K, N]
    fold: int = 0  # bm=1, out-major: sum each run of `fold` inputs within a thread every step
    widen: str = "convert"  # how int8 weights reach the tensor cores (bm > 1), see `widen`
    weights_first: bool = False  # out-major, bm > 1: the dot is w [bn, bk] x x^T, the weights its left operand

    def label(self) -> str:
        return (
            f"pallas bm={self.bm} bn={self.bn} bk={self.bk} split={self.split} warps={self.warps}"
            + (f" fold={self.fold}" if self.fold else "")
            + (" out-major" if self.out_major else "")
            + (f" widen={self.widen}" if self.bm > 1 and self.widen != "convert" else "")
            + (" weights-first" if self.weights_first else "")
        )


@dataclass(frozen=True)
class RowNorm:
    """An RMSNorm the kernel applies to x's rows as it loads them: x * rsqrt(mean(x^2) + eps) *
    (offset + w[idx]) in float32, rounded to x's dtype as `layers.rms_norm` does (a program that
    sees a whole row applies the rsqrt to its sums instead, unrounded). w is a weight [K] or a
    stack [L, K] (None: no weight)."""

    w: jax.Array | None
    idx: jax.Array | int
    eps: float
    offset: float = 0.0


SMS = 132  # H100/H200 multiprocessors: the grid should cover them a few times


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


SMEM = 200 * 1024  # of the 227 KiB a block may use on H100/H200, leaving Triton some room


def _blocks(M: int, N: int, bm: int, bn: int) -> int:
    return -(-M // bm) * -(-N // bn)


def table_entry(M: int, N: int, out_major: bool, gated: bool) -> Entry:
    """The table entry (`matmul_tiles`) of the device kind for an M-row product of N outputs: the
    first of its class's alternatives whose blocks, split `max_split` ways, reach its `cover`."""
    return next(
        e
        for e in entries(device_kind(), M, out_major, gated)
        if _blocks(M, N, e.bm, e.bn) * e.max_split >= e.cover * SMS
    )


def choose_tiles(M: int, K: int, N: int, gated: bool = False, w_bytes: int = 1, **kw) -> Tiles:
    """Blocks for an [M, K] x [K, N] product (N summed over the weights of a fused call): the device
    kind's table entry for it (`table_entry`), as `tiles_of` completes it with `kw` (its `bn`, `bk`
    and `warps` replace the entry's where given; `psum_after`: a row-parallel shard under tensor
    parallelism, all-reduced next)."""
    return tiles_of(table_entry(M, N, kw.get("out_major", False), gated), M, K, N, gated, w_bytes, **kw)


def tiles_of(
    e: Entry,
    M: int,
    K: int,
    N: int,
    gated: bool = False,
    w_bytes: int = 1,
    *,
    bn=None,
    bk=None,
    warps=None,
    out_major: bool = False,
    outputs: int = 1,
    psum_after: bool = False,
    widen: str | None = None,
) -> Tiles:
    """The tiles of table entry `e` for an [M, K] x [K, N] product: K split until the blocks cover
    the GPU `e.fill` times (decode is memory-bound: enough blocks in flight, not arithmetic reuse),
    as far as `e.max_split` allows; as many pipeline stages as fit in shared memory. A single
    output's partials are summed in whatever XLA fuses next (the residual add after O and down);
    fused outputs go on to a kernel, and a row-parallel shard's to the all-reduce (`e.whole`,
    `e.narrow`)."""
    bk_ = min(e.bk, max(16, _pow2(K))) if out_major and e.bm == 1 else e.bk
    target, bn_ = e.fill * SMS, e.bn
    if (
        e.narrow
        and psum_after
        and outputs == 1
        and bn is None
        and _blocks(M, N, e.bm, bn_) < target
        and _blocks(M, N, e.bm, e.narrow) >= 2 * SMS
    ):
        bn_ = e.narrow
    bn, bk, warps = bn or bn_, bk or bk_, warps or e.warps
    blocks = _blocks(M, N, e.bm, bn)
    if e.narrow and psum_after and bn == e.narrow:
        target = blocks  # the narrow blocks stand in for the split
    if e.whole and outputs > 1 and blocks >= e.whole * SMS:
        target = blocks  # no split: the partials' sums would be a kernel per output
    split = 1
    while split < e.max_split and blocks * split < target and K >= 2 * split * bk:
        split *= 2
    stages, n_w = 3, 2 if gated else 1
    while stages > 1 and stages * bk * (e.bm * 2 + n_w * bn * w_bytes) > SMEM:  # pipelined tiles
        stages -= 1
    # A vector product output-major sums each run of 16 contiguous inputs within the thread that
    # holds them every step, so the accumulator is a sixteenth of the tile and the registers freed
    # keep more loads in flight (Qwen3-4B batch 1 on one H100: 388-391 tok/s against 352-353).
    fold = 16 if out_major and e.bm == 1 and bk % 16 == 0 else 0
    return Tiles(
        bm=e.bm,
        bn=bn,
        bk=bk,
        split=split,
        warps=warps,
        stages=stages,
        out_major=out_major,
        fold=fold,
        widen=widen or widening.default(),
        weights_first=e.weights_first,
    )


def _load_x(x_ref, i, k0, t: Tiles, M, K):
    ks = k0 + jnp.arange(t.bk)
    if t.bm == 1:
        return plgpu.load(x_ref.at[i, pl.ds(k0, t.bk)], mask=ks < K, other=0.0)
    rows = i * t.bm + jnp.arange(t.bm)
    return plgpu.load(
        x_ref.at[pl.ds(i * t.bm, t.bm), pl.ds(k0, t.bk)], mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0
    )


def _load_w(w_ref, layer, j, k0, t: Tiles, K, N):
    """The layer's [bk, bn] weight tile, or [bn, bk] from an output-major stack."""
    ks = k0 + jnp.arange(t.bk)
    cols = j * t.bn + jnp.arange(t.bn)
    if t.out_major:
        return plgpu.load(
            w_ref.at[layer, pl.ds(j * t.bn, t.bn), pl.ds(k0, t.bk)],
            mask=(cols < N)[:, None] & (ks < K)[None, :],
            other=0,
        )
    return plgpu.load(
        w_ref.at[layer, pl.ds(k0, t.bk), pl.ds(j * t.bn, t.bn)], mask=(ks < K)[:, None] & (cols < N)[None, :], other=0
    )


def _product(x, w, t: Tiles):
    if t.bm == 1:  # elementwise; runs of `fold` inputs summed within the thread
        xf = x.astype(jnp.float32)
        p = widening.widen(w, jnp.float32, "magic") * (xf[None, :] if t.out_major else xf[:, None])
        if t.fold and t.out_major:
            p = jnp.sum(p.reshape(t.bn, t.bk // t.fold, t.fold), axis=2)
        return p
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    if t.weights_first:
        return jax.lax.dot_general(
            widening.widen(w, x.dtype, t.widen),
            x,
            (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
            precision=precision,
        )
    return jax.lax.dot_general(
        x,
        widening.widen(w, x.dtype, t.widen),
        (((1,), (1 if t.out_major else 0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=precision,
    )


def _x_loader(x_ref, i, t: Tiles, M, K, norm=None):
    """(load, finish): load(k0) is this program's x tile at k0. With norm = (weight stack ref or
    None, index, eps, offset), each row normalized as `RowNorm` says. Where one program covers a
    whole row (one row, K not split), the row's mean square is summed in the main loop: load
    returns (x times the norm weight, x squared) and the sums are scaled by finish(summed squares)
    at the end, the norm being linear in x. Otherwise the mean square is summed over all of K first
    (the row is a few kilobytes, read again from the cache) and finish is None."""

    def plain(k0):
        return _load_x(x_ref, i, k0, t, M, K)

    if norm is None:
        return plain, None
    w_ref, idx, eps, offset = norm

    def weight(k0):
        ks = k0 + jnp.arange(t.bk)
        w = plgpu.load(w_ref.at[idx, pl.ds(k0, t.bk)], mask=ks < K, other=0.0).astype(jnp.float32)
        return offset + (w if t.bm == 1 else w[None, :])

    if t.bm == 1 and t.split == 1:

        def weighted(k0):
            x = plain(k0).astype(jnp.float32)
            return (x if w_ref is None else x * weight(k0)), x * x

        return weighted, lambda sq: jax.lax.rsqrt(jnp.sum(sq) / K + eps)

    def squares(n, acc):
        x = plain(n * t.bk).astype(jnp.float32)
        return acc + x * x

    acc = jnp.zeros((t.bk,) if t.bm == 1 else (t.bm, t.bk), jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(jax.lax.fori_loop(0, -(-K // t.bk), squares, acc), axis=-1) / K + eps)

    def normed(k0):
        x = plain(k0)
        y = x.astype(jnp.float32) * (inv if t.bm == 1 else inv[:, None])
        if w_ref is not None:
            y = y * weight(k0)
        return y.astype(x.dtype)

    return normed, None


def _accumulate(loader, w_refs, layer, j, s, steps, t: Tiles, K, N):
    """[bm, bn] float32 sums over this program's K range for each weight in w_refs."""
    load_x, finish = loader
    k_lo = s * steps * t.bk
    shape = (
        ((t.bn, t.bk // (t.fold or 1)) if t.out_major else (t.bk, t.bn))
        if t.bm == 1
        else (t.bn, t.bm)
        if t.weights_first
        else (t.bm, t.bn)
    )
    acc = tuple(jnp.zeros(shape, jnp.float32) for _ in w_refs)
    sq = () if finish is None else (jnp.zeros((t.bk,), jnp.float32),)  # the row's squares

    def body(n, carry):
        acc, sq = carry
        k0 = k_lo + n * t.bk
        x = load_x(k0)
        if finish is not None:
            x, x2 = x
            sq = (sq[0] + x2,)
        return tuple(a + _product(x, _load_w(w, layer, j, k0, t, K, N), t) for a, w in zip(acc, w_refs)), sq

    acc, sq = jax.lax.fori_loop(0, steps, body, (acc, sq))
    if t.bm == 1:
        acc = tuple(jnp.sum(a, axis=1 if t.out_major else 0)[None, :] for a in acc)
    elif t.weights_first:
        acc = tuple(a.T for a in acc)
    if finish is not None:
        inv = finish(sq[0])
        acc = tuple(a * inv for a in acc)
    return acc


def _scaled(acc, s_ref, layer, j, t: Tiles, N):
    if s_ref is None:
        return acc
    cols = j * t.bn + jnp.arange(t.bn)
    return acc * plgpu.load(s_ref.at[layer, pl.ds(j * t.bn, t.bn)], mask=cols < N, other=0.0)[None, :]


def _store(o_ref, val, i, j, t: Tiles, M, N, split_index=None):
    rows = i * t.bm + jnp.arange(t.bm)
    cols = j * t.bn + jnp.arange(t.bn)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    at = (pl.ds(i * t.bm, t.bm), pl.ds(j * t.bn, t.bn))
    ref = o_ref.at[at] if split_index is None else o_ref.at[(split_index,) + at]
    plgpu.store(ref, val.astype(o_ref.dtype), mask=mask)


def _matmul_kernel(layer_ref, x_ref, *refs, t: Tiles, M, K, Ns, steps, scaled, norm):
    """Column blocks of several weights side by side in one grid: block j belongs to the weight
    whose range of blocks holds it, and only that weight's branch runs. With `norm` = (has a
    weight, eps, offset), x's rows are normalized on the way in (the first refs: index, weight)."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if norm is not None:
        has_w, eps, offset = norm
        w_ref = refs[1] if has_w else None
        loader = _x_loader(x_ref, i, t, M, K, (w_ref, refs[0][0], eps, offset))
        refs = refs[1 + has_w :]
    else:
        loader = _x_loader(x_ref, i, t, M, K)
    n = len(Ns)
    w_refs, o_refs = refs[:n], refs[-n:]
    s_refs = refs[n : 2 * n] if scaled else (None,) * n
    layer = layer_ref[0]
    first = 0
    for w_ref, s_ref, o_ref, N in zip(w_refs, s_refs, o_refs, Ns):
        nb = -(-N // t.bn)

        @pl.when((j >= first) & (j < first + nb))
        def _(w_ref=w_ref, s_ref=s_ref, o_ref=o_ref, N=N, jj=j - first):
            (acc,) = _accumulate(loader, (w_ref,), layer, jj, s, steps, t, K, N)
            if t.split == 1:
                _store(o_ref, _scaled(acc, s_ref, layer, jj, t, N), i, jj, t, M, N)
            else:
                _store(o_ref, acc, i, jj, t, M, N, split_index=s)

        first += nb


def _gated_kernel(layer_ref, x_ref, wg_ref, wu_ref, *rest, t: Tiles, M, K, N, steps, scaled, act):
    sg_ref, su_ref = rest[:2] if scaled else (None, None)
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    g, u = _accumulate(_x_loader(x_ref, i, t, M, K), (wg_ref, wu_ref), layer, j, s, steps, t, K, N)
    if t.split == 1:
        g = _scaled(g, sg_ref, layer, j, t, N)
        u = _scaled(u, su_ref, layer, j, t, N)
        _store(rest[-1], act(g) * u, i, j, t, M, N)
    else:  # partial sums; XLA finishes the gate
        _store(rest[-2], g, i, j, t, M, N, split_index=s)
        _store(rest[-1], u, i, j, t, M, N, split_index=s)


def _params(t: Tiles):
    return plgpu.CompilerParams(num_warps=t.warps, num_stages=t.stages)


def stack_dims(arr, n_contract: int, out_major: bool):
    """(contracted, output) parts of a stack [L, *in, *out] ([L, *out, *in] if out_major): of its
    shape, or of the entries of its PartitionSpec when given one."""
    d = arr.shape[1:] if hasattr(arr, "shape") else tuple(arr)[1:]
    n_out = len(d) - n_contract
    return (d[n_out:], d[:n_out]) if out_major else (d[:n_contract], d[n_contract:])


def _dims(w, out_major: bool):
    """(K, N) of a [L, K, N] stack, or of a [L, N, K] one when out_major."""
    (K,), (N,) = stack_dims(w, 1, out_major)
    return K, N


def stacked_matmuls(
    x,
    weights,
    layer,
    tiles: Tiles | None = None,
    out_major: bool = False,
    summed: bool = True,
    out_dtype=None,
    log_as: str = "matmul",
    norm: RowNorm | None = None,
    psum_after: bool = False,
) -> list:
    """[x @ w[layer] * scale[layer] for (w [L, K, N_i], scale [L, N_i] | None) in weights], in one
    kernel launch (e.g. the Q, K and V projections of a layer); w is [L, N_i, K] when out_major.
    The outputs are x's dtype unless `out_dtype` says otherwise; the tile choice is logged as
    `log_as`. With `summed=False` a K-split product comes back as its float32 partials
    [split, M, N_i], unscaled (for a kernel that sums them itself). With `norm`, x is the input of
    an RMSNorm the kernel applies to each row as it loads it. `psum_after`: the product is a
    row-parallel shard, all-reduced next (see `choose_tiles`)."""
    out_dtype = out_dtype or x.dtype
    M, K = x.shape
    Ns = [_dims(w, out_major)[1] for w, _ in weights]
    for w, _ in weights:
        assert _dims(w, out_major)[0] == K, (x.shape, w.shape, out_major)
    scaled = weights[0][1] is not None
    assert all((sc is not None) == scaled for _, sc in weights)
    t = tiles or choose_tiles(
        M, K, sum(Ns), w_bytes=weights[0][0].dtype.itemsize, out_major=out_major, outputs=len(Ns), psum_after=psum_after
    )
    assert t.out_major == out_major, (t, out_major)
    note(
        log_as,
        (M, K, "+".join(map(str, Ns)), str(weights[0][0].dtype)),
        t.label() + (" rms-norm" if norm is not None else ""),
    )
    steps = -(-K // (t.bk * t.split))
    grid = (-(-M // t.bm), sum(-(-N // t.bn) for N in Ns), t.split)
    out_shape = [
        jax.ShapeDtypeStruct((M, N), out_dtype) if t.split == 1 else jax.ShapeDtypeStruct((t.split, M, N), jnp.float32)
        for N in Ns
    ]
    normed, norm_args = None, ()
    if norm is not None:
        normed = (norm.w is not None, norm.eps, norm.offset)
        norm_args = (jnp.reshape(norm.idx, (1,)).astype(jnp.int32),) + (
            () if norm.w is None else (norm.w if norm.w.ndim == 2 else norm.w[None],)
        )
    kernel = functools.partial(_matmul_kernel, t=t, M=M, K=K, Ns=tuple(Ns), steps=steps, scaled=scaled, norm=normed)
    args = (
        (jnp.reshape(layer, (1,)).astype(jnp.int32), x)
        + norm_args
        + tuple(w for w, _ in weights)
        + (tuple(sc for _, sc in weights) if scaled else ())
    )
    outs = pallas_call(kernel, out_shape=out_shape, grid=grid, compiler_params=_params(t), name="stacked_matmul")(*args)
    if t.split == 1 or not summed:
        return list(outs)
    res = []
    for out, (_, sc) in zip(outs, weights):
        out = out.sum(axis=0)
        if sc is not None:
            out = out * jax.lax.dynamic_index_in_dim(sc, layer, keepdims=False)
        res.append(out.astype(out_dtype))
    return res


def stacked_matmul(x, w, scale, layer, tiles: Tiles | None = None, out_major: bool = False):
    """x [M, K] @ w[layer] ([L, K, N] int8 or float; [L, N, K] when out_major) * scale[layer]
    ([L, N], or None) -> [M, N]."""
    return stacked_matmuls(x, [(w, scale)], layer, tiles, out_major)[0]


def stacked_gated(x, gate, up, layer, act, tiles: Tiles | None = None, out_major: bool = False):
    """act(x @ gate[layer]) * (x @ up[layer]) for (weight [L, K, N] or [L, N, K] when out_major,
    scale [L, N] | None) pairs."""
    (wg, sg), (wu, su) = gate, up
    M, K = x.shape
    N = _dims(wg, out_major)[1]
    t = tiles or choose_tiles(M, K, N, gated=True, w_bytes=wg.dtype.itemsize, out_major=out_major)
    assert t.out_major == out_major and _dims(wg, out_major)[0] == K, (t, out_major, wg.shape)
    note("gated matmul", (M, K, N, str(wg.dtype)), t.label())
    steps = -(-K // (t.bk * t.split))
    scaled = sg is not None
    kernel = functools.partial(_gated_kernel, t=t, M=M, K=K, N=N, steps=steps, scaled=scaled, act=act)
    args = (jnp.reshape(layer, (1,)).astype(jnp.int32), x, wg, wu) + ((sg, su) if scaled else ())
    grid = (-(-M // t.bm), -(-N // t.bn), t.split)
    if t.split == 1:
        out_shape = jax.ShapeDtypeStruct((M, N), x.dtype)
    else:
        out_shape = [jax.ShapeDtypeStruct((t.split, M, N), jnp.float32)] * 2
    out = pallas_call(kernel, out_shape=out_shape, grid=grid, compiler_params=_params(t), name="stacked_gated")(*args)
    if t.split == 1:
        return out
    g, u = out[0].sum(axis=0), out[1].sum(axis=0)
    if scaled:
        g = g * jax.lax.dynamic_index_in_dim(sg, layer, keepdims=False)
        u = u * jax.lax.dynamic_index_in_dim(su, layer, keepdims=False)
    return (act(g) * u).astype(x.dtype)
