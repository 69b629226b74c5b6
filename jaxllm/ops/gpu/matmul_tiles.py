"""The matmul kernels' tiles as measured: a table per GPU kind, keyed by the product's shape class,
each entry beside the measurement that chose it. `matmul.choose_tiles` looks the class up and
derives the rest from the shape (the K split that fills the GPU, the pipeline stages that fit
shared memory, the fold).

A class is (rows, out_major, gated). `rows` is the most rows a product of the class has (None: any
more); its fewest are one more than the next smaller count of the table for the same layout and
gating, so each table cuts the rows where its GPU needs it (the H200's at 128). `out_major` is the
weights' layout (`ops.gpu.weights`), `gated` the gated MLP's fused gate/up product. A class maps to
an `Entry`, or to a tuple of them of which the first whose blocks reach its `cover` is taken.

`scripts/kernel_bench.py --tune` times each class's entry and its neighbours (`candidates`) over a
model's shapes on the GPU at hand and prints the fastest in this format, for a table of its kind
(`TABLES`). A GPU kind without a table takes the H100's, where most entries were measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """A tile (`matmul.Tiles` less what follows from the shape) and how far K may be split."""

    bm: int  # rows per block; 1 = a vector product reduced in registers, else tensor-core dots
    bn: int  # output columns per block
    bk: int  # contraction step (an output-major vector product's: at most K, rounded up to a power of 2)
    warps: int
    max_split: int = 1  # blocks along K at most, each writing float32 partials
    fill: int = 4  # K is split until the blocks cover the multiprocessors this many times
    weights_first: bool = False  # output-major: the dot is w x^T, the weights its left operand
    cover: int = 0  # taken where its blocks, split max_split ways, cover the multiprocessors this many times
    whole: int = 0  # fused outputs (Q, K, V): no split where the blocks cover the GPU this many times
    narrow: int = 0  # a row-parallel shard (`psum_after`): this many channels a block, unsplit, where
    # the entry's blocks do not reach `fill` and the narrow ones cover the GPU twice

    def __repr__(self) -> str:
        """The entry as the tables write it: the tile, then the fields that differ from the default."""
        rest = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)[4:]
            if getattr(self, f.name) != f.default
        ]
        return f"Entry({', '.join(map(str, (self.bm, self.bn, self.bk, self.warps, *rest)))})"


# The H100's, and any GPU's without a table of its own.
H100 = {
    # One row: a vector product, each thread multiplying its part of a weight tile into a float32
    # accumulator reduced across threads once at the end (a reduction per tile stalls the loads).
    # Input-major, shallow steps over narrow K ranges in many blocks of 8 warps streamed int8
    # weights fastest (about four blocks a multiprocessor).
    (1, False, False): Entry(1, 64, 32, 8, max_split=16),
    (1, False, True): Entry(1, 128, 32, 8, max_split=4),
    # Output-major, 16 channels by 512 contiguous inputs a step, K split until about three blocks a
    # multiprocessor (blocks of 4 channels timed faster alone but slower inside the decode step).
    # Fused outputs, each of whose partials' sums would be an XLA kernel of its own, are not split
    # where their blocks cover the GPU twice (Qwen3-4B batch 1: 2.6% faster; single outputs, whose
    # sums fuse into the residual add, 5-15% slower unsplit: Gemma 4 31B's O and down). A row-parallel
    # shard's partials would be summed by a kernel of their own before the all-reduce: 8-channel
    # blocks unsplit instead (Gemma 4 31B's O on one H200, as one of 4 / 2 devices holds it, 2903 /
    # 3318 GB/s against 1688 / 2385 split, its down at TP=2 2380 against 2044 and at TP=4 even; the
    # model at TP=2 on two H200s, batch 1, 106.9-107.2 tok/s against 101.7-102.3), but not on one
    # device, where they cost Qwen3-4B's batch 1 6%.
    (1, True, False): Entry(1, 16, 512, 8, max_split=16, fill=3, whole=2, narrow=8),
    # 8 warps for the gated product: 382.8-384.0 tok/s against 380.1-380.2 with 4 (Qwen3-4B batch 1).
    (1, True, True): Entry(1, 16, 512, 8, max_split=4, fill=3, whole=2, narrow=8),
    # 2 to 16 rows: tensor-core dots of 16 rows. Output-major, more and smaller blocks of 4 warps, 64
    # channels for a projection, 32 where 64 split in 4 would not cover the GPU twice, and 32 for the
    # gated product (Qwen3-4B batch 8: 2265 tok/s against 2214-2219 for 128 channels in 8 warps;
    # 2315-2319 against 2256-2262 with the gated product on 64 and O and down on 32; then 2343-2366
    # against 2295-2312 with the gated product on 32; on 16, 1990). A gated product over 16-row
    # tiles is not split, its partials' sum an XLA kernel of its own (Qwen3-4B batch 8: 2108-2114
    # tok/s unsplit, 2074-2092 split in 4).
    (16, False, False): Entry(16, 128, 128, 8, max_split=4),
    (16, False, True): Entry(16, 128, 128, 8),
    (16, True, False): (Entry(16, 64, 128, 4, max_split=4, cover=2), Entry(16, 32, 128, 4, max_split=4)),
    (16, True, True): Entry(16, 32, 128, 4),
    # 17 to 64 rows: 32- and 64-row dots. Output-major, the gated product in 32-row tiles of 64
    # channels, 4 warps, unsplit, with no float32 partials written, read back and gated by an XLA
    # kernel (Qwen3-4B, µs a layer: 28.6 against 30.6 + 3.0 at 32 rows, 37.2 against 41.9 + 5.6 at
    # 64, 58.1 against 70.4 + 6.0 at 128); the projections the same up to 32 rows (batch 32:
    # Qwen3-4B 4968 / 4997 tok/s against 4903 / 4909 in 128 channels, Gemma 4 31B on one H200 1546
    # against 1494 / 1495), not at 64 (slower on an H200), where 4 warps were even with 8
    # (Qwen3-4B batch 64: 5815-5872 tok/s against 5837-5853).
    (32, False, False): Entry(32, 128, 128, 8, max_split=4),
    (32, False, True): Entry(32, 128, 128, 8, max_split=4),
    (32, True, False): Entry(32, 64, 128, 4, max_split=4),
    (32, True, True): Entry(32, 64, 128, 4),
    (64, False, False): Entry(64, 128, 128, 8, max_split=4),
    (64, False, True): Entry(64, 128, 128, 8, max_split=4),
    (64, True, False): Entry(64, 128, 128, 8, max_split=4),
    (64, True, True): Entry(32, 64, 128, 4),
    # Above 64 rows, the same, split in 2 at most.
    (None, False, False): Entry(64, 128, 128, 8, max_split=2),
    (None, False, True): Entry(64, 128, 128, 8, max_split=2),
    (128, True, False): Entry(64, 128, 128, 8, max_split=2),
    (128, True, True): Entry(32, 64, 128, 4),
    # Above 128 rows, output-major, the weights are the dot's left operand, 64 channels a block in
    # one warpgroup, so each widened int8 tile feeds Hopper's tensor cores from registers (Qwen3-4B's
    # decode step at batch 256, ctx 512: 16.35-16.39 ms against 17.89-17.98; µs a layer at 256 /
    # 512 rows: Q/K/V 29.8 / 47.3 against 42.4 / 73.8, down 58.9 / 80.8 against 70.0 / 126.7, the
    # gated product 97.2 / 148.8 against 115.9 / 226.6; on one H200, Qwen3-4B's layer at 256 rows
    # 217 against 262 and Gemma 4 31B's per-GPU layer at TP=4 232 against 266 at 256 rows and 385
    # against 419 at 512, its Q/K/V alone slower, 64.9 against 56.4); at 64 rows the projections
    # alone were 10-15% faster but the step was not, and at 128 the step was 1% slower.
    (None, True, False): Entry(128, 64, 64, 4, max_split=2, weights_first=True),
    (None, True, True): Entry(128, 64, 64, 4, weights_first=True),
}

H200 = {
    **H100,
    # The batch-1 gated product in 4 warps: the H200's HBM wants more loads in flight than an
    # H100's (Gemma 4 31B batch 1: 83.9 tok/s against 79.9; at TP=2 111.3 and 111.7 against 106.7
    # and 106.9).
    (1, True, True): Entry(1, 16, 512, 4, max_split=4, fill=3, whole=2, narrow=8),
    # So do the projections' 64-row tiles, to 127 rows (Gemma 4 31B batch 64: 1453-1457 tok/s
    # against 1409-1413).
    (64, True, False): Entry(64, 128, 128, 4, max_split=4),
    (127, True, False): Entry(64, 128, 128, 4, max_split=2),
    (127, True, True): Entry(32, 64, 128, 4),
    # 128 rows in 128-row tiles, which widen each weight tile once for every 128 rows rather than
    # every 64, where they still give half as many blocks as multiprocessors (Gemma 4 31B, µs a
    # layer at 128 / 256 rows: the gated product 227 / 450 against 276 / 508 in 64-row tiles, Q/K/V
    # 65 / 117 against 81 / 149, down at 256 rows 198 against 252; at 128 rows, 42 blocks, 161
    # against 135).
    (128, True, False): (Entry(128, 128, 64, 8, max_split=2, cover=1), Entry(64, 128, 128, 4, max_split=2)),
    (128, True, True): (Entry(128, 128, 64, 8, max_split=2, cover=1), Entry(32, 64, 128, 4)),
}

TABLES = {"H200": H200, "H100": H100}  # by a part of the device kind ("NVIDIA H200", "NVIDIA GH200 480GB")
DEFAULT = H100


def table_for(device_kind: str) -> dict:
    return next((t for name, t in TABLES.items() if name in device_kind), DEFAULT)


def shape_class(table: dict, M: int, out_major: bool, gated: bool) -> tuple:
    """The key of the class of an M-row product in `table`."""
    counts = sorted(r for r, om, g in table if om == out_major and g == gated and r is not None)
    return next((r for r in counts if M <= r), None), out_major, gated


def entries(device_kind: str, M: int, out_major: bool, gated: bool) -> tuple[Entry, ...]:
    """The entry, or the alternatives in order, of an M-row product's class on `device_kind`."""
    table = table_for(device_kind)
    e = table[shape_class(table, M, out_major, gated)]
    return e if isinstance(e, tuple) else (e,)


def candidates(e: Entry, M: int, out_major: bool) -> list[Entry]:
    """`e` as a plain entry (no `cover`), then its neighbours one field away, for
    `scripts/kernel_bench.py --tune` to time on M rows: `bn` and `bk` halved and doubled, 4 or 8
    warps, `max_split` halved and doubled (up to 16); above one row `bm` halved and doubled (16 to
    128 rows, at most M's power of two), and output-major the other operand order."""
    base = dataclasses.replace(e, cover=0)
    out = [base]

    def add(**change):
        c = dataclasses.replace(base, **change)
        if c not in out and c.bn >= (4 if c.bm == 1 else 16) and c.bk >= 16 and 1 <= c.max_split <= 16:
            out.append(c)

    for name in ("bn", "bk", "max_split"):
        v = getattr(base, name)
        add(**{name: v // 2})
        add(**{name: v * 2})
    for w in (4, 8):
        add(warps=w)
    if base.bm > 1:
        for bm in (base.bm // 2, base.bm * 2):
            if 16 <= bm <= min(128, max(16, 1 << (M - 1).bit_length())):
                add(bm=bm)
        if out_major:
            add(weights_first=not base.weights_first)
    return out
