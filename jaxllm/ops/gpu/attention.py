"""Decode attention over one layer of a paged KV pool, GQA-grouped and split over the sequence.

One query token per row, at absolute position `pos[b]`, attends over the positions its row holds
in layer `layer` of a kind's pool (`kv.paged`), read in place through the row's block table. A
program takes one (row, KV head, sequence chunk): it loads the query heads that share that KV head
once, streams the chunk's K/V tiles through an online softmax, and writes an unnormalised partial
with its running max and sum; a second kernel merges the chunks by log-sum-exp.

The chunks split the tiles a row can see: from position 0 for a global kind, from the first
position of the window for a sliding one, so the programs of a sliding kind all fall inside the
window. A tile is `bs` logical positions, gathered from the pages that hold them (`pages`: the
page and tile sizes are independent), and masked by those positions alone: causal, in the window,
never negative. A table column read for a position outside that range may hold a newer block (a
ring of blocks) or none: nothing there is loaded.

One kernel serves every pool:
- compute-dtype K/V;
- int8 K/V with a float32 scale per position and head, folded into the scores and the
  probabilities (no dequantized tile is formed);
- keys rebuilt from the stored values (Gemma 4's k_eq_v layers): RMS-normed and rotated per tile.

The head dimension is read as pieces (static (start, width) ranges, each loaded at a power-of-two
width, its dots summed): one piece, or where keys are rebuilt, the dimensions RoPE rotates in each
half and, apart, those it leaves as they are. Gemma 4's global layers rotate a quarter of them
(`partial_rotary_factor` 0.25), so only that quarter pays for the rotation and its angle table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.ops.gpu import note, pages, pallas_call
from jaxllm.ops.gpu import widen as widening
from jaxllm.ops.gpu.matmul import SMS, _pow2
from jaxllm.ops.xla import KeysFromValues

NEG = -1e30


def _pieces(width: int, start: int) -> list[tuple[int, int]]:
    """[start, start + width) as (start, width) pieces loaded at power-of-two widths of 16 or more
    (a dot's least depth): split where one load would leave a quarter of its lanes idle."""
    out = []
    while width > 0:
        p = _pow2(width)
        if (p - width) * 4 >= p and p // 2 >= 16:
            p //= 2
        out.append((start, min(p, width)))
        start, width = start + min(p, width), width - min(p, width)
    return out


def head_pieces(hd: int, inv_freq: np.ndarray | None) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(rot, pieces) of the head dimension: without RoPE in the kernel (inv_freq None) one piece;
    with it, the first `rot` dimensions of each half (up to the last non-zero frequency) as the
    first two pieces, then the rest of each half, which a zero frequency leaves unrotated."""
    if inv_freq is None:
        return 0, ((0, hd),)
    w = hd // 2
    nz = np.flatnonzero(np.asarray(inv_freq))
    rot = max(1, int(nz[-1]) + 1 if nz.size else 1)
    return rot, (((0, rot), (w, rot)) + tuple(_pieces(w - rot, rot)) + tuple(_pieces(w - rot, w + rot)))


def _kernel(
    *refs, names, G, hd, P, M, bs, chunk, scale, softcap, window, precision, keys, way, kway, pieces, prefetch, ahead
):
    r = dict(zip(names, refs))
    o_ref, m_ref, l_ref = refs[len(names) :]
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    gp = max(16, _pow2(G))
    layer, pos = r["layer"][0], r["pos"][b]
    gmask = jnp.arange(gp) < G
    pw = [max(16, _pow2(w)) for _, w in pieces]  # each piece's load width
    pm = [jnp.arange(p) < w for p, (_, w) in zip(pw, pieces)]
    pds = [pl.ds(jnp.int32(st), p) for p, (st, _) in zip(pw, pieces)]
    cols = [(st + jnp.arange(p))[None, :] for p, (st, _) in zip(pw, pieces)]
    qs = [
        plgpu.load(r["q"].at[b, h, pl.ds(0, gp), d], mask=gmask[:, None] & m[None, :], other=0.0)
        for d, m in zip(pds, pm)
    ]
    dt = qs[0].dtype
    # The positions the query sees, [lo, hi) (none for a negative position), and this chunk's tiles
    # of them, counted from the tile of the first.
    lo = jnp.int32(0) if window is None else jnp.maximum(pos - window + 1, 0)
    hi = pos + 1
    t_lo = lo // bs + sp * chunk
    t_hi = jnp.maximum(jnp.minimum(t_lo + chunk, pl.cdiv(hi, bs)), t_lo)

    # A piece as wide as its load is masked by rows alone, which keeps the loads vectorized along
    # the head (measured on one H200: int8 rings 8-11% faster).
    full = [p == w for p, (_, w) in zip(pw, pieces)]

    # A tile within one page is a slice of consecutive pool rows, loaded as a contiguous cache's
    # tile is (Triton vectorizes it along the head); a tile over several pages gathers their rows.
    # On one H200 (Qwen3-4B's layers, 32K positions) gathered tiles took 1.65x the time at batch 64.
    sliced = bs <= P

    def load_kv(name, rows, valid):
        if sliced:
            return [
                plgpu.load(
                    r[name].at[layer, rows, h, d], mask=valid[:, None] if f else valid[:, None] & m[None, :], other=0
                )
                for d, m, f in zip(pds, pm, full)
            ]
        return [
            plgpu.load(
                r[name].at[layer, rows[:, None], h, c],
                mask=valid[:, None] if f else valid[:, None] & m[None, :],
                other=0,
            )
            for c, m, f in zip(cols, pm, full)
        ]

    def rebuilt_keys(vals, vscale, t):
        x = [widening.widen(a, jnp.float32, kway) * (1.0 if vscale is None else vscale[:, None]) for a in vals]
        x = [a.astype(dt).astype(jnp.float32) for a in x]  # the values as the model holds them
        eps, offset, has_norm = keys
        if has_norm:
            ms = sum(jnp.sum(a * a, axis=1) for a in x) / hd
            inv = jax.lax.rsqrt(ms + eps)[:, None]
            ws = [plgpu.load(r["norm_w"].at[d], mask=m, other=0.0).astype(jnp.float32) for d, m in zip(pds, pm)]
            x = [(a * inv * (offset + wv[None, :])).astype(dt).astype(jnp.float32) for a, wv in zip(x, ws)]
        # pieces 0 and 1 rotate together (their widths are equal); the others pass through. Positions
        # t*bs + j: sine and cosine of the tile's angle (one per frequency) combined with those of the
        # in-tile angles j*f, a small table read from cache. Sine and cosine of every position's
        # angle cost 5x the rest of the kernel.
        rp, rm = pw[0], pm[0]
        freq = plgpu.load(r["inv_freq"].at[pl.ds(0, rp)], mask=rm, other=0.0)
        base = (t * bs).astype(jnp.float32) * freq
        cb, sb = jnp.cos(base)[None, :], jnp.sin(base)[None, :]
        cj = plgpu.load(r["rope_j"].at[jnp.int32(0), pl.ds(0, bs), pl.ds(0, rp)], mask=rm[None, :], other=1.0)
        sj = plgpu.load(r["rope_j"].at[jnp.int32(1), pl.ds(0, bs), pl.ds(0, rp)], mask=rm[None, :], other=0.0)
        c, s = cb * cj - sb * sj, sb * cj + cb * sj
        return [(x[0] * c - x[1] * s).astype(dt), (x[1] * c + x[0] * s).astype(dt)] + [a.astype(dt) for a in x[2:]]

    def visible(t):
        si = t * bs + jnp.arange(bs)
        return (si >= lo) & (si < hi)

    def fetch(t, blocks):
        """Tile t as stored (values, keys, scales) from the pages `blocks`; positions the query does
        not see are not loaded."""
        valid = visible(t)
        rows = pl.ds(blocks[0] * P + (t * bs) % P, bs) if sliced else pages.tile_rows(blocks, t, bs=bs, P=P)
        tiles = {"v": load_kv("v", rows, valid)}
        if "k" in r:
            tiles["k"] = load_kv("k", rows, valid)
        for name in ("k_scale", "v_scale"):
            if name in r:
                tiles[name] = plgpu.load(r[name].at[layer, rows, h], mask=valid, other=0.0)
        return tiles

    def attend_tile(t, tiles, carry):
        accs, m, l = carry
        valid = visible(t)
        vals, vscale = tiles["v"], tiles.get("v_scale")
        if keys is not None:
            ks, kscale = rebuilt_keys(vals, vscale, t), None
        else:
            ks, kscale = [widening.widen(a, dt, way) for a in tiles["k"]], tiles.get("k_scale")
        s = sum(
            jax.lax.dot_general(
                qa, ka, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
            )
            for qa, ka in zip(qs, ks)
        )
        if kscale is not None:
            s = s * kscale[None, :]
        s = s * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        s = jnp.where(valid[None, :], s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        l = l * corr + jnp.sum(p, axis=1)
        if vscale is not None:  # fold V's scales into the probabilities
            p = p * vscale[None, :]
        accs = [
            acc * corr[:, None]
            + jax.lax.dot_general(
                p.astype(dt),
                widening.widen(va, dt, way),
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
                precision=precision,
            )
            for acc, va in zip(accs, vals)
        ]
        return accs, m_new, l

    init = (
        [jnp.zeros((gp, p), jnp.float32) for p in pw],
        jnp.full((gp,), NEG, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    ids = functools.partial(pages.tile_pages, r["table"], b, bs=bs, P=P, M=M)
    if prefetch:
        # Tile t + 1's loads in flight while tile t is computed; its block ids loaded `ahead` tiles before.
        def body(t, blocks, c):
            return (*attend_tile(t, c[3], c[:3]), fetch(t + 1, blocks))

        accs, m, l, _ = pages.fori(t_lo, t_hi, lambda t: ids(t + 1), ahead, body, (*init, fetch(t_lo, ids(t_lo))))
    else:
        # Triton's pipelining issues tile t + 1's loads during tile t: their block ids `ahead` tiles before.
        accs, m, l = pages.fori(t_lo, t_hi, ids, ahead, lambda t, blocks, c: attend_tile(t, fetch(t, blocks), c), init)
    for acc, d, dmask in zip(accs, pds, pm):
        plgpu.store(o_ref.at[sp, b, h, pl.ds(0, gp), d], acc, mask=gmask[:, None] & dmask[None, :])
    plgpu.store(m_ref.at[sp, b, h, pl.ds(0, gp)], m, mask=gmask)
    plgpu.store(l_ref.at[sp, b, h, pl.ds(0, gp)], l, mask=gmask)


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, n, hd, dc):
    """One (row, query head, slice of the head dimension): every chunk's partial loaded at once and
    merged by log-sum-exp, as XLA's merge does (a loop over the chunks was latency-bound)."""
    b, j, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    npd = _pow2(n)
    nm = jnp.arange(npd) < n
    dm = c * dc + jnp.arange(dc) < hd
    m = plgpu.load(m_ref.at[pl.ds(0, npd), b, j], mask=nm, other=NEG)
    l = plgpu.load(l_ref.at[pl.ds(0, npd), b, j], mask=nm, other=0.0)
    wts = jnp.where(nm, jnp.exp(m - jnp.max(m)), 0.0)
    den = jnp.sum(l * wts)
    o = plgpu.load(o_ref.at[pl.ds(0, npd), b, j, pl.ds(c * dc, dc)], mask=nm[:, None] & dm[None, :], other=0.0)
    acc = jnp.sum(o * wts[:, None], axis=0)
    out = jnp.where(den > 0, acc / jnp.where(den > 0, den, 1.0), 0.0)  # 0: a row with no key to read
    plgpu.store(out_ref.at[b, j, pl.ds(c * dc, dc)], out.astype(out_ref.dtype), mask=dm)


def merge_chunks(o, m, l, dtype):
    """Partials o [n, B, K, G, ...hd] with running max m and sum l [n, B, K, G] -> [B, K * G, hd] in
    `dtype`, by one kernel (XLA's merge was three or four kernels a layer). One warp a program: the
    kernel is all latency, and on one H100 (Qwen3-4B, ctx 2048) it took 1.9 µs a layer at batch 1
    and 1.6 at batch 8 against 2.3 and 1.8 with 4 warps (batch 64: 2.3 either way)."""
    n, B, K, G = m.shape
    hd = o.size // m.size
    dc = min(_pow2(hd), max(16, 4096 // _pow2(n)))  # about 4096 partial values a program
    kernel = functools.partial(_merge_kernel, n=n, hd=hd, dc=dc)
    return pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, K * G, hd), dtype),
        grid=(B, K * G, pl.cdiv(hd, dc)),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name="merge_chunks",
    )(o.reshape(n, B, K * G, hd), m.reshape(n, B, K * G), l.reshape(n, B, K * G))


def choose_split(B: int, K: int, tiles: int) -> int:
    """Sequence chunks per (row, KV head): enough programs for about two per multiprocessor."""
    want = -(-2 * SMS // (B * K))
    return max(1, min(want, tiles))


def decode_attention(
    q,
    pool: dict,
    layer,
    table,
    pos,
    *,
    scale: float,
    softcap=None,
    window=None,
    keys: KeysFromValues | None = None,
    block: int | None = None,
    splits: int | None = None,
    warps: int | None = None,
    widen: str | None = None,
    prefetch: bool | None = None,
    ahead: int | None = None,
):
    """q [B, H, hd] at positions pos [B] over layer `layer` [] of a kind's pool, `pool` its arrays
    (`kv.paged.LayerKV.arrays`: v [L, N, P, K, hd], k unless `keys` says how to rebuild keys from
    the values, k_scale and v_scale [L, N, P, K] where int8), through the rows' block table
    table [B, M] -> [B, H, hd] in q's dtype.
    `block`: positions a tile (a power of two; any page size). `widen`: how int8 K/V reach the
    dots and, for keys rebuilt from values, float32 (`kernels.widen`; by default
    `JAXLLM_INT8_WIDEN`, else `convert` for the dots and `magic` for the rebuild).
    `prefetch`: each tile's loads are issued while the tile before it is computed, by the kernel's
    own loop rather than Triton's pipelining; by default for int8 pools, whose loads Triton does
    not pipeline past the widening (measured on one H200: 7% faster on int8 rings, the bf16 ring
    15% slower with it). `ahead`: tiles before its own that a tile's block ids are loaded (0: in
    its own iteration)."""
    B, H, hd = q.shape
    _, _, P, K, _ = pool["v"].shape
    M = table.shape[1]
    G = H // K
    if keys is not None and hd % 2:
        raise ValueError(f"keys rebuilt from values need an even head_dim, got {hd}")
    int8 = pool["v"].dtype == jnp.int8
    if prefetch is None:
        prefetch = int8
    if ahead is None:
        # A tile's block ids loaded a tile ahead: on one H200 at 32K positions (Qwen3-4B's layers)
        # 128 us at batch 1 and 2272 at 64, against 152 and 2495 two tiles ahead, about the
        # contiguous cache's 130 and 2323.
        ahead = 1
    # Tile and warps measured on one H100 at batch 64: keys rebuilt from int8 values take 338 us a
    # layer at head_dim 512 in tiles of 32 with 8 warps (7.4 ms in tiles of 64 with 4, which spill
    # registers) and 177 us at head_dim 256 in tiles of 16 with 4. On one H200 at batches 64 and 128
    # (Gemma 4's layers), int8 caches loaded a tile ahead and bf16 rings of head_dim 256 ran 15-30%
    # faster with 2 warps a program (4 at head_dim 512) than with 8.
    if keys is not None:
        bs, warps = block or (16 if hd <= 256 else 32), warps or (4 if hd <= 256 else 8)
    elif int8 and prefetch:
        bs, warps = block or 64, warps or (2 if hd <= 256 else 4)
    elif hd == 256:
        bs, warps = block or 32, warps or 2
    else:
        bs = block or (64 if hd <= 256 else 32)
        warps = warps or (8 if bs * hd >= 16384 else 4)
    if bs & (bs - 1):
        raise ValueError(f"a tile of positions must be a power of two, got {bs}")
    # The tiles one row may see: every one of the table for a global kind; for a sliding one, those
    # its window spans from any first position (no more positions than the table holds).
    tiles = -(-M * P // bs) if window is None else -(-(min(window, M * P) - 1) // bs) + 1
    n = splits or choose_split(B, K, tiles)
    chunk = -(-tiles // n)
    n = -(-tiles // chunk)
    kind = ("sliding" if window is not None else "global") + (" keys-from-values" if keys else "")
    way, kway = widen or widening.default(), widen or widening.default("magic")
    note(
        "decode attention",
        (B, H, K, M * P, hd, str(pool["v"].dtype), kind),
        f"pallas block={bs} page={P} warps={warps} splits={n}"
        + (f" widen={way}" if int8 and way != "convert" else "")
        + (f" keys-widen={kway}" if keys is not None and int8 else "")
        + (" prefetch" if prefetch else ""),
    )
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    rot, pieces = head_pieces(hd, None if keys is None else keys.inv_freq)
    ins = {
        "layer": jnp.reshape(layer, (1,)).astype(jnp.int32),
        "pos": pos.astype(jnp.int32),
        "table": table.astype(jnp.int32),
        "q": q.reshape(B, K, G, hd),
    }
    ins.update({name: pages.flat(a) for name, a in pool.items() if a is not None})
    if keys is not None:
        inv_freq = np.asarray(keys.inv_freq, np.float32)[:rot]  # the rotated dimensions' only
        ang = np.arange(bs, dtype=np.float32)[:, None] * inv_freq[None, :]
        ins.update(
            inv_freq=jnp.asarray(inv_freq),
            norm_w=keys.norm_w,
            rope_j=jnp.asarray(np.stack([np.cos(ang), np.sin(ang)]), jnp.float32),
        )
        ins.pop("k", None)
        ins.pop("k_scale", None)
    ins = {k: v for k, v in ins.items() if v is not None}
    kernel = functools.partial(
        _kernel,
        names=tuple(ins),
        G=G,
        hd=hd,
        P=P,
        M=M,
        bs=bs,
        chunk=chunk,
        scale=scale,
        softcap=softcap,
        window=window,
        precision=precision,
        keys=None if keys is None else (keys.eps, keys.offset, keys.norm_w is not None),
        way=way,
        kway=kway,
        pieces=pieces,
        prefetch=prefetch,
        ahead=ahead,
    )
    out_shape = (
        jax.ShapeDtypeStruct((n, B, K, G, hd), jnp.float32),
        jax.ShapeDtypeStruct((n, B, K, G), jnp.float32),
        jax.ShapeDtypeStruct((n, B, K, G), jnp.float32),
    )
    o, m, l = pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, K, n),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=2),
        name="decode_attention",
    )(*ins.values())
    return merge_chunks(o, m, l, q.dtype).reshape(B, H, hd)
