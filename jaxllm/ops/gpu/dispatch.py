"""The model-facing side of the kernels: take the model's own operands (a `Stacked` weight of any
rank, a layer's view of a paged KV pool), decide whether a kernel takes them, and reshape in
and out. Each function returns None where the XLA path should run instead.

On a tensor-parallel mesh (`kernels.use_layout`) a kernel runs per device inside `shard_map`, on the
shards the layout's rules give each operand: column-parallel weights (Q, K, V, gate, up) produce
their output sharded like their output axis; row-parallel ones (O, down) contract a sharded axis
and sum the partial products over the "model" axis; attention runs on each device's heads, over
its KV heads of the pools (whose blocks every device holds) through the rows' block tables.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import PartitionSpec as P

from jaxllm.config.axes import cache_leaf_axes
from jaxllm.ops.gpu import current_layout, note
from jaxllm.ops.gpu.attention import decode_attention
from jaxllm.ops.gpu.matmul import RowNorm, stack_dims, stacked_gated, stacked_matmuls
from jaxllm.ops.gpu.norm import residual_norm
from jaxllm.ops.gpu.prefill import prefill_attention
from jaxllm.ops.gpu.prologue import SplitQKV, decode_prologue
from jaxllm.ops.gpu.types import Normed, Partials, Stacked
from jaxllm.ops.xla import HeadPrep
from jaxllm.quant import QuantArray

MAX_ROWS = 256  # above this many rows (a prefill) a step is compute-bound: XLA's GEMMs
HEAD_ROWS = 64  # the output head is wide enough to be compute-bound above this
# A matmul normalizes its input rows (`Normed`) for up to this many. Each program needs the rows'
# mean squares: one row it sums in its main loop, but several rows it read once more first, which
# at 8 rows cost more than the two XLA kernels it saved (one H100: batch 1 +5%, batch 8 -2%, batch
# 64 -3%). Above this, the model ends each layer with the next layer's norm instead (`add_norm`).
NORM_ROWS = 1


def _arrays(w: Stacked):
    if isinstance(w.stack, QuantArray):
        return w.stack.q, w.stack.scale
    return w.stack, None


def weight_axes(axes: tuple, n_contract: int, out_major: bool) -> tuple:
    """Logical axes of a stack of a layer weight whose layer has `axes` ([*in, *out]), in its
    storage order."""
    return ("layers",) + (axes[n_contract:] + axes[:n_contract] if out_major else axes)


def _local(fn, layout, in_specs, out_specs):
    """fn on one device's shards when the layout has a tensor-parallel axis, else fn itself."""
    if layout is None or layout.mesh.size == 1:
        return fn
    return jax.shard_map(fn, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _weight_specs(layout, w: Stacked, n_contract: int):
    """PartitionSpecs of the stack and of its scales, and whether the model axis splits a
    contracted dim (a row-parallel weight)."""
    arr, scale = _arrays(w)
    spec = layout.spec(arr.shape, weight_axes(w.axes, n_contract, w.out_major))
    ins, outs = stack_dims(spec, n_contract, w.out_major)
    sspec = None if scale is None else P(spec[0], *outs)
    return spec, sspec, any(s is not None for s in ins)


def _flat(arr, scale, n_contract: int, out_major: bool):
    """[L, *in, *out] (and scales [L, *out]) -> [L, K, N], [L, N] | None; [L, N, K] if out_major."""
    ins, outs = stack_dims(arr, n_contract, out_major)
    L, K, N = arr.shape[0], math.prod(ins), math.prod(outs)
    return arr.reshape((L, N, K) if out_major else (L, K, N)), (None if scale is None else scale.reshape(L, N))


def _too_many_rows(x, n_contract, name, desc, limit=MAX_ROWS):
    M = math.prod(x.shape[: x.ndim - n_contract])
    if M > limit:
        note(name, (M,) + desc, f"xla ({M} rows > {limit})")
        return True
    return False


def _sharding_plan(ws, n_contract, x):
    """(layout, weight specs, scale specs, x spec, output specs, psum?) or None for XLA."""
    layout = current_layout()
    if layout is None or layout.mesh.size == 1:
        return layout, None
    if any(w.axes is None for w in ws):
        return layout, "unknown"
    full = [_weight_specs(layout, w, n_contract) for w in ws]
    contract_split = {split for _, _, split in full}
    if len(contract_split) != 1:
        return layout, "mixed"
    row_parallel = contract_split.pop()
    specs = [(spec, sspec) for spec, sspec, _ in full]
    lead = [None] * (x.ndim - n_contract)
    if row_parallel:  # x arrives split along the contracted axes, like the weight
        ins, _ = stack_dims(specs[0][0], n_contract, ws[0].out_major)
        xspec = P(*lead, *ins)
        outs = [P(*lead, *([None] * (len(s) - 1 - n_contract))) for s, _ in specs]
    else:
        xspec = P()
        outs = [P(*lead, *stack_dims(s, n_contract, w.out_major)[1]) for (s, _), w in zip(specs, ws)]
    return layout, (specs, xspec, outs, row_parallel)


def stacked_linears(x, ws: list, n_contract: int, partials: bool = False):
    """One kernel launch for several Stacked weights contracted with the same x (Q, K and V). With
    `partials`, on one device, the outputs of a K-split launch come back as `Partials`.
    x may be `Normed`: the kernel normalizes its rows as it loads them where it can, and XLA does
    it first where it cannot (too many rows, rows split over devices)."""
    norm = x if isinstance(x, Normed) else None
    if norm is not None:
        fuse = n_contract == 1 and math.prod(norm.x.shape[:-1]) <= NORM_ROWS
        x, norm = (norm.x, norm) if fuse else (norm.value(), None)
    arrs = [_arrays(w) for w in ws]
    om = ws[0].out_major
    if (
        len(
            {
                (stack_dims(a, n_contract, w.out_major)[0], w.out_major, a.dtype, s is None)
                for (a, s), w in zip(arrs, ws)
            }
        )
        != 1
    ):
        return None
    desc = (
        math.prod(stack_dims(arrs[0][0], n_contract, om)[0]),
        "+".join(str(math.prod(stack_dims(a, n_contract, om)[1])) for a, _ in arrs),
        str(arrs[0][0].dtype),
    )
    if _too_many_rows(x, n_contract, "matmul", desc):
        return None
    layout, plan = _sharding_plan(ws, n_contract, x)
    if isinstance(plan, str):
        note("matmul", desc, f"xla (weights {plan} for the sharded kernels)")
        return None
    if norm is not None and plan is not None and plan[3]:
        x, norm = norm.value(), None  # rows split over devices: no device sees a whole row
    quant = arrs[0][1] is not None
    lead = x.shape[: x.ndim - n_contract]
    n = len(ws)
    keep = partials and plan is None
    nw, nidx = _in_stack(None if norm is None else norm.w)

    def body(x, layer, nw, nidx, *flat):
        pairs = list(zip(flat[:n], flat[n:] if quant else [None] * n))
        mats = [_flat(a, s, n_contract, om) for a, s in pairs]
        k_local = math.prod(stack_dims(pairs[0][0], n_contract, om)[0])  # K over a shard's rows
        rows = None if norm is None else RowNorm(nw, nidx, norm.eps, norm.offset)
        ys = stacked_matmuls(
            x.reshape(-1, k_local),
            mats,
            layer,
            out_major=om,
            summed=not keep,
            norm=rows,
            psum_after=plan is not None and plan[3],
        )
        if keep and ys[0].ndim == 3:  # K split: the float32 partials, unscaled
            return tuple(
                Partials(
                    y.reshape(y.shape[:1] + lead + stack_dims(a, n_contract, om)[1]),
                    None if s is None else Stacked(s, layer),
                    x.dtype,
                )
                for y, (a, s) in zip(ys, pairs)
            )
        ys = [y.reshape(lead + stack_dims(a, n_contract, om)[1]) for y, (a, _) in zip(ys, pairs)]
        if plan is not None and plan[3]:
            ys = [jax.lax.psum(y, "model") for y in ys]
        return tuple(ys)

    flat = [a for a, _ in arrs] + ([sc for _, sc in arrs] if quant else [])
    if plan is None:
        return list(body(x, ws[0].idx, nw, nidx, *flat))
    specs, xspec, outs, _ = plan
    in_specs = (xspec, P(), P(), P()) + tuple(w for w, _ in specs) + (tuple(sc for _, sc in specs) if quant else ())
    return list(_local(body, layout, in_specs, tuple(outs))(x, ws[0].idx, nw, nidx, *flat))


def _in_stack(w):
    """(weight, or the stack a `Stacked` view reads, and its index); (None, 0) for None."""
    if w is None:
        return None, 0
    return (w.stack, w.idx) if isinstance(w, Stacked) else (w, 0)


def stacked_linear(x, w: Stacked, n_contract: int, partials: bool = False):
    ys = stacked_linears(x, [w], n_contract, partials)
    return None if ys is None else ys[0]


def gated(x, gate, up, act):
    """act(x @ gate) * (x @ up) in one kernel, for Stacked gate/up weights of the same shape."""
    if not (isinstance(gate, Stacked) and isinstance(up, Stacked)):
        return None
    (wg, sg), (wu, su) = _arrays(gate), _arrays(up)
    om = gate.out_major
    if wg.shape != wu.shape or wg.dtype != wu.dtype or (sg is None) != (su is None) or up.out_major != om:
        return None
    (K,), (N,) = stack_dims(wg, 1, om)
    if _too_many_rows(x, 1, "gated matmul", (K, N, str(wg.dtype))):
        return None
    layout, plan = _sharding_plan([gate, up], 1, x)
    if isinstance(plan, str) or (plan is not None and plan[3]):
        note("gated matmul", (K, N, str(wg.dtype)), "xla (sharding)")
        return None
    lead = x.shape[:-1]
    quant = sg is not None

    def body(x, layer, wg, wu, *scales):
        sg, su = scales if quant else (None, None)
        y = stacked_gated(x.reshape(-1, x.shape[-1]), (wg, sg), (wu, su), layer, act, out_major=om)
        return y.reshape(lead + y.shape[-1:])

    args = (x, gate.idx, wg, wu) + ((sg, su) if quant else ())
    if plan is None:
        return body(*args)
    (specs, xspec, outs, _) = plan
    (gspec, gs), (uspec, us) = specs
    in_specs = (xspec, P(), gspec, uspec) + ((gs, us) if quant else ())
    return _local(body, layout, in_specs, outs[0])(*args)


def paged_attention(q, layer_kv, positions, *, scale, softcap, window, keys=None):
    """Attention of q [B, T, H, hd] at positions [B, T] over a layer of a paged pool
    (`kv.paged.LayerKV`), read in place through the rows' block table: the decode kernel for one
    query token a row, the prefill kernel for more (a prompt's chunk, a speculative verify). None
    where XLA should run it: more than one token a row over keys rebuilt from values, or query
    and KV heads split differently over the devices."""
    B, T, H, hd = q.shape
    arrays = layer_kv.arrays()
    v = arrays["v"]
    K = v.shape[3]
    decode = T == 1
    what = "decode attention" if decode else "prefill attention"
    desc = (B, T, H, K, str(v.dtype))
    if not decode and keys is not None:
        note(what, desc, "xla (keys rebuilt from values)")
        return None
    names = tuple(arrays)

    def run(q, idx, pos, table, norm_w, *arrs):
        pool = dict(zip(names, arrs))
        if not decode:
            return prefill_attention(q, pool, idx, table, pos, scale=scale, softcap=softcap, window=window)
        ks = None if keys is None else dataclasses.replace(keys, norm_w=norm_w)
        return decode_attention(
            q[:, 0], pool, idx, table, pos[:, 0], scale=scale, softcap=softcap, window=window, keys=ks
        )[:, None]

    args = (q, layer_kv.idx, positions, layer_kv.table, None if keys is None else keys.norm_w) + tuple(arrays.values())
    layout = current_layout()
    if layout is None or layout.mesh.size == 1:
        return run(*args)
    qspec = layout.spec(q.shape, ("batch", "seq", "q_heads", "head_dim"))
    specs = tuple(layout.spec(a.shape, cache_leaf_axes(a.ndim)) for a in arrays.values())
    if not _kv_split_ok(qspec[2], specs[names.index("v")][3], K, what, desc):
        return None
    rows = P(qspec[0], None)  # positions and block tables follow the batch rows
    return _local(run, layout, (qspec, P(), rows, rows, P()) + specs, qspec)(*args)


def _kv_split_ok(q_heads_spec, kv_spec, K: int, what: str, desc: tuple) -> bool:
    """Whether each device's query heads read only KV heads it holds: the same split, or one KV
    head replicated on every device."""
    heads_split, kv_split = q_heads_spec is not None, kv_spec is not None
    if heads_split == kv_split or (heads_split and K == 1):
        return True
    note(what, desc, "xla (query and KV heads split differently)")
    return False


def prologue(q, k, v, prep: HeadPrep, positions, layer_cache):
    """Rotated queries [B, 1, H, hd] and `layer_cache` (`kv.paged.LayerKV`) with this step's K/V
    written into its blocks, from raw projections of one token per row (k, v None: queries alone,
    for a layer reading another's cache), by `prologue.decode_prologue`. None where XLA should do
    it."""
    layout = current_layout()
    parts = [y for y in (q, k, v) if isinstance(y, Partials)]
    if parts and (
        len(parts) != len([y for y in (q, k, v) if y is not None]) or (layout is not None and layout.mesh.size > 1)
    ):
        return None  # partials only all together, on one device
    B, T, H, hd = q.shape if not parts else q.parts.shape[1:]
    if T != 1 or hd % 2:
        return None
    pool = layer_cache.arrays() if k is not None else {}
    idx, table = (layer_cache.idx, layer_cache.table) if k is not None else (0, None)
    norms = [n for n in (prep.q_norm, prep.k_norm) if n is not None]
    widx = next((n.idx for n in norms if isinstance(n, Stacked)), 0)
    if len({isinstance(n, Stacked) for n in norms}) > 1:
        note("decode prologue", (B, H, hd), "xla (head norms not all in their layer stacks)")
        return None
    qn, kn = (n.stack if isinstance(n, Stacked) else n for n in (prep.q_norm, prep.k_norm))
    names = tuple(pool)

    split = None
    if parts:  # K-split projections, summed in the kernel
        scales = [None if y is None or y.scale is None else y.scale for y in (q, k, v)]
        sidx = next((sc.idx for sc in scales if sc is not None), 0)
        split = SplitQKV(tuple(None if sc is None else sc.stack for sc in scales), sidx, q.dtype)
        q, k, v = (None if y is None else y.parts[:, :, 0] for y in (q, k, v))
    else:
        q, k, v = (None if y is None else y[:, 0] for y in (q, k, v))

    def run(q, k, v, pos, idx, table, widx, qn, kn, *arrs):
        p = dataclasses.replace(prep, q_norm=qn, k_norm=kn, norm_layer=widx)
        qo, out = decode_prologue(q, k, v, p, pos, dict(zip(names, arrs)), idx, table, split=split)
        return (qo[:, None],) + tuple(out[n] for n in names)

    args = (q, k, v, positions[:, 0], idx, table, widx, qn, kn) + tuple(pool.values())
    if layout is None or layout.mesh.size == 1:
        got = run(*args)
    else:
        qspec = layout.spec(q.shape, ("batch", "q_heads", "head_dim"))
        specs = [layout.spec(a.shape, cache_leaf_axes(a.ndim)) for a in pool.values()]
        if k is not None:
            if qspec[0] is not None:  # each device would write its rows' blocks into its copy alone
                note("decode prologue", (B, H, hd), "xla (rows split over devices, the pool's blocks not)")
                return None
            K = pool["v"].shape[3]
            kvspec = layout.spec(k.shape, ("batch", "kv_heads", "head_dim"))
            if not _kv_split_ok(qspec[1], kvspec[1], K, "decode prologue", (B, H, K, hd)):
                return None
        else:
            kvspec = P()
        rows = P(qspec[0])  # positions and block tables follow the batch rows
        fn = _local(
            run,
            layout,
            (qspec, kvspec, kvspec, rows, P(), P(*rows, None), P(), P(), P()) + tuple(specs),
            (P(qspec[0], None, *qspec[1:]),) + tuple(specs),
        )
        got = fn(*args)
    new = layer_cache.with_arrays(dict(zip(names, got[1:]))) if k is not None else layer_cache
    return got[0], new


def add_norm(x, y, post, pre, eps: float, offset: float, h_into=None):
    """(x + rms_norm(y, post), rms_norm of that with `pre`) by `norm.residual_norm`, for up to
    MAX_ROWS rows; y may be `Partials`; the second is written over `h_into` where one is given.
    Under tensor parallelism every device computes it on the whole (replicated) rows. None where
    XLA should do it."""
    M = math.prod(x.shape[:-1])
    if M > MAX_ROWS or pre is None:
        return None
    layout = current_layout()
    if isinstance(y, Partials) and layout is not None and layout.mesh.size > 1:
        return None

    (pw, pi), (qw, qi) = _in_stack(post), _in_stack(pre)
    parts, (sc, si) = (y.parts, _in_stack(y.scale)) if isinstance(y, Partials) else (y, (None, 0))

    def run(x, parts, sc, si, pw, pi, qw, qi, *into):
        lead = x.shape[:-1]
        ys = parts.reshape((parts.shape[0], M, -1) if isinstance(y, Partials) else (M, -1))
        xo, h = residual_norm(
            x.reshape(M, -1),
            ys,
            (sc, si),
            (pw, pi),
            (qw, qi),
            eps=eps,
            offset=offset,
            h_into=into[0].reshape(M, -1) if into else None,
        )
        return xo.reshape(x.shape), h.reshape(lead + h.shape[-1:])

    into = () if h_into is None or h_into.shape != x.shape or h_into.dtype != x.dtype else (h_into,)
    args = (x, parts, sc, si, pw, pi, qw, qi) + into
    if layout is None or layout.mesh.size == 1:
        return run(*args)
    return _local(run, layout, (P(),) * len(args), (P(), P()))(*args)


def output_head(h, table, tied: bool):
    """float32 logits [..., V] of h [..., D] by the stacked-matmul kernel: against every row of a
    tied embedding table [V, D] (already output-major), or through an untied lm_head [D, V]; int8
    with a scale per vocabulary entry, or float. On a tensor-parallel mesh each device computes the
    logits of its own vocabulary rows, so the result comes out vocabulary-sharded. None where XLA
    should do it."""
    q, scale = (table.q, table.scale) if isinstance(table, QuantArray) else (table, None)
    V, D = q.shape if tied else q.shape[::-1]
    desc = (D, V, str(q.dtype))
    if _too_many_rows(h, 1, "output head", desc, HEAD_ROWS):
        return None
    scale = None if scale is None else scale.reshape(V)
    lead = h.shape[:-1]

    def run(h, q, *sc):
        y = stacked_matmuls(
            h.reshape(-1, h.shape[-1]),
            [(q[None], sc[0][None] if sc else None)],
            0,
            out_major=tied,
            out_dtype=jax.numpy.float32,
            log_as="output head",
        )[0]
        return y.reshape(lead + y.shape[-1:])

    args = (h, q) + (() if scale is None else (scale,))
    layout = current_layout()
    if layout is None or layout.mesh.size == 1:
        return run(*args)
    tspec = layout.spec(q.shape, ("vocab", "embed") if tied else ("embed", "vocab"))
    vocab, embed = tspec if tied else tspec[::-1]
    if embed is not None:
        note("output head", desc, "xla (the embedding dim is sharded)")
        return None
    in_specs = (P(), tspec) + (() if scale is None else (P(vocab),))
    return _local(run, layout, in_specs, P(*([None] * len(lead)), vocab))(*args)
