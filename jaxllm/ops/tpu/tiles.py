"""Tile sizes of the paged attention kernel (`attention.py`), per head_dim, storage dtype and head
grouping, sized for a v6e TensorCore: a 256-wide MXU, vregs of (8, 128) 32-bit words, so (16, 128)
bf16 and (32, 128) int8 tiles, and 128 MiB of VMEM of which the kernel asks for at most
`VMEM_LIMIT` (v5e has as much; a v7x TensorCore has 64 MiB).

A step of the kernel's loop reads `pages` KV blocks of every local KV head and multiplies them with
a tile of `rows` query rows (tokens x the query heads sharing a KV head): about 256 of each fills
the MXU, while a decode step (one token a row) is bound by the blocks' bytes whatever its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MXU = 256  # a v6e MXU's width: query rows and KV positions a step aims for
VMEM_BUDGET = 24 << 20  # what the tiles below may take of VMEM...
VMEM_LIMIT = 48 << 20  # ...and what the kernel may allocate (Mosaic's own temporaries beside)
SMEM_TABLES = 256 << 10  # block-table bytes one call keeps in SMEM (1 MiB on v4 and later)


def sublanes(dtype) -> int:
    """Rows of a native tile of `dtype`: 8 32-bit words, packed 2 or 4 to a word below 32 bits."""
    return 8 * 4 // np.dtype(dtype).itemsize


@dataclass(frozen=True)
class Tiles:
    tokens: int  # query tokens of a tile (its rows: tokens x query heads per KV head)
    pages: int  # KV blocks a step reads into one of its two buffers

    def vmem(self, K: int, G: int, hd: int, P: int, q_dtype, kv_dtype, int8: bool) -> int:
        """Bytes of VMEM the kernel's buffers take: the pipelined query and output tiles (two of
        each), the float32 accumulator and softmax statistics, the two KV buffers (and scales),
        a step's keys and values staged by head in the query dtype, and a head's float32 scores."""
        R, n = self.tokens * G, self.pages * P
        qo = 2 * 2 * K * R * hd * np.dtype(q_dtype).itemsize
        stats = K * R * (hd + 2 * 128) * 4
        kv = 2 * 2 * n * K * hd * np.dtype(kv_dtype).itemsize + (2 * 2 * n * K * 4 if int8 else 0)
        staged = 2 * K * n * hd * np.dtype(q_dtype).itemsize + (2 * K * 8 * n * 4 if int8 else 0)
        return qo + stats + kv + staged + 2 * R * n * 4


def choose(T: int, K: int, G: int, hd: int, P: int, q_dtype, kv_dtype, int8: bool) -> Tiles:
    """Tiles for T query tokens a row over pages of P positions of K heads: a tile takes every
    token where they make at most `MXU` rows (decode, a speculative verify, a short chunk), else
    a multiple of the query dtype's tile rows; a step reads `MXU` positions (one block where a
    block's positions are not whole tiles of the KV dtype: the kernel lays a step's blocks end to
    end as one matrix). Both halve until the buffers fit `VMEM_BUDGET`."""
    sub = sublanes(q_dtype)
    tokens = T if T * G <= MXU else max(sub, MXU // G // sub * sub)
    pages = max(1, MXU // P) if P % sublanes(kv_dtype) == 0 else 1
    t = Tiles(tokens, pages)
    while t.vmem(K, G, hd, P, q_dtype, kv_dtype, int8) > VMEM_BUDGET and (t.pages > 1 or t.tokens > sub):
        if t.pages > 1:
            t = Tiles(t.tokens, t.pages // 2)
        else:
            t = Tiles(max(sub, t.tokens // 2 // sub * sub), t.pages)
    return t
