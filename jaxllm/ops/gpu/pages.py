"""Where a kernel finds a tile of a row's positions in a paged KV pool (`kv.paged`).

A pool [L, N, P, K, hd] (scales [L, N, P, K]) reaches the attention kernels flattened to
[L, N * P, K, hd] (`flat`): position p of row b is pool row table[b, (p // P) % M] * P + p % P, for
a table of M columns. A kernel reads keys and values a tile of `bs` positions at a time, bs and
P powers of two:
- bs <= P: the tile lies in one page: one block id, bs consecutive pool rows;
- bs > P: the tile spans bs / P pages: a block id each, P consecutive pool rows each.
Either way the tile is one load of a [bs, width] block of pointers, gathered over its pages' rows
and contiguous along the head dimension (as a contiguous cache's tile, whose rows are K * hd
elements apart too, so its loads vectorize the same), with its int8 scales a [bs] gather beside it.
So the page size does not bound the tile: the tiles tuned on contiguous caches stay.

A tile's block ids are scalar loads of the table (`tile_pages`) that its K/V loads depend on. The
loops (`fori`) issue them some tiles ahead and carry them, so that their latency is spent under
earlier tiles' work rather than between a tile's address and its load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def flat(a: jax.Array) -> jax.Array:
    """A pool leaf [L, N, P, ...] as [L, N * P, ...] (a reshape XLA makes a bitcast)."""
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def tile_pages(table_ref, b, t, *, bs: int, P: int, M: int) -> tuple:
    """Block ids (scalars) of the pages tile t (positions t*bs ..) of row b covers: max(1, bs/P).
    Every column is read modulo M, so ids past a row's last block are some block's, in bounds."""
    first = (t * bs) // P
    return tuple(table_ref[b, (first + i) % M] for i in range(max(1, bs // P)))


def tile_rows(pages: tuple, t, *, bs: int, P: int) -> jax.Array:
    """Rows [bs] of the flattened pool that hold tile t's positions, from its pages' block ids."""
    j = jnp.arange(bs)
    if bs <= P:
        return pages[0] * P + (t * bs) % P + j
    base = pages[0] * P
    for i, blk in enumerate(pages[1:], 1):
        base = jnp.where(j >= i * P, blk * P, base)
    return base + jax.lax.rem(j, P)


def fori(lo, hi, ids, ahead: int, body, init):
    """`fori_loop(lo, hi)` of body(t, pages, carry), where pages = ids(t) was loaded `ahead`
    iterations earlier (carried in a queue; the first `ahead` before the loop; 0: in its own)."""
    if ahead == 0:
        return jax.lax.fori_loop(lo, hi, lambda t, c: body(t, ids(t), c), init)

    def step(t, c):
        carry, queue = c
        return body(t, queue[0], carry), queue[1:] + (ids(t + ahead),)

    return jax.lax.fori_loop(lo, hi, step, (init, tuple(ids(lo + i) for i in range(ahead))))[0]
