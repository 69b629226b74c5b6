"""The residual add after a block and the next block's RMSNorm in one kernel.

    x' = x + rms_norm(y, post)   (x + y where there is no post-norm)
    h  = rms_norm(x', pre)

On the XLA path this is two to four small kernels (the reductions cannot fuse with the
normalisations that broadcast them), and where the matmul producing y split its K dimension, XLA
also sums the partials there. Here one program takes one row whole: it sums the float32 partials
and applies the matmul's per-channel scale itself, rounding each stage to the compute dtype as the
XLA path does. Norm weights and scales may be layer stacks, read in place at their index.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.ops.gpu import note, pallas_call
from jaxllm.ops.gpu.matmul import _pow2


def _kernel(*refs, names, D, split, eps, offset):
    r = dict(zip(names, refs))
    xo_ref, h_ref = refs[len(names) :]
    i = pl.program_id(0)
    dp = _pow2(D)
    dm = jnp.arange(dp) < D
    dt = xo_ref.dtype

    def row(name, *lead):
        return plgpu.load(r[name].at[lead + (pl.ds(0, dp),)], mask=dm, other=0.0).astype(jnp.float32)

    # Every load first: each reduction below is a barrier, which no load issued after it can pass.
    x = row("x", i)
    ys = [row("y", jnp.int32(s), i) for s in range(split)] if split else [row("y", i)]
    w = {n: row(n, r[n + "_idx"][0]) for n in ("scale", "post", "pre") if n in r}

    def norm(v, name):
        inv = jax.lax.rsqrt(jnp.sum(v * v) / D + eps)
        return (v * inv * (offset + w[name])).astype(dt).astype(jnp.float32)

    y = sum(ys) * w["scale"] if "scale" in w else sum(ys)
    y = y.astype(dt).astype(jnp.float32)  # the matmul's output, as it would have stored it
    if "post" in w:
        y = norm(y, "post")
    x = (x + y).astype(dt)
    plgpu.store(xo_ref.at[i, pl.ds(0, dp)], x, mask=dm)
    plgpu.store(h_ref.at[i, pl.ds(0, dp)], norm(x.astype(jnp.float32), "pre").astype(dt), mask=dm)


def residual_norm(x, y, scale, post, pre, *, eps: float, offset: float = 0.0, h_into=None):
    """x [M, D]; y [M, D], or float32 partials [split, M, D] with `scale` = (per-channel scales [D]
    or a stack [L, D], index) or (None, 0), summed, scaled and cast to x's dtype; `post`, `pre` =
    (norm weight [D] or stack [L, D], index), `post` (None, 0) for none. Returns (x', h), x's dtype.
    x' is written over x's buffer, and h over `h_into`'s ([M, D], x's dtype) where one is given, so
    a residual stream carried through a loop is updated in place rather than copied."""
    M, D = x.shape
    split = y.shape[0] if y.ndim == 3 else 0
    ins = {"x": x, "y": y}
    for name, (w, idx) in (("scale", scale), ("post", post), ("pre", pre)):
        if w is not None:
            ins[name] = w if w.ndim == 2 else w[None]
            ins[name + "_idx"] = jnp.reshape(idx, (1,)).astype(jnp.int32)
    aliases = {0: 0}  # each program reads its row whole before writing it
    if h_into is not None:
        assert h_into.shape == x.shape and h_into.dtype == x.dtype, (h_into.shape, x.shape)
        aliases[len(ins)] = 1
        ins["h_into"] = h_into
    note("residual norm", (M, D, split or "-", str(x.dtype)), "pallas")
    kernel = functools.partial(_kernel, names=tuple(ins), D=D, split=split, eps=eps, offset=offset)
    out = jax.ShapeDtypeStruct((M, D), x.dtype)
    return pallas_call(
        kernel,
        out_shape=(out, out),
        grid=(M,),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=8 if _pow2(D) >= 4096 else 4, num_stages=1),
        name="residual_norm",
    )(*ins.values())
