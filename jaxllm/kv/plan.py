"""How many KV blocks each attention kind gets, said before they are allocated, and a clear error
when they cannot fit.

A lockstep batch gets exactly its rows' blocks (`PoolPlan.for_rows`). A server's pool is sized from
a memory budget (`PoolPlan.for_budget`): sliding kinds get room for every slot's window, twice over
(the second for cached prefixes' windows) where the rest still holds every slot at its longest,
and global kinds the rest, so a pool holds as many tokens of global KV as the budget allows
whatever the requests' lengths.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import jax

from jaxllm.errors import RequestError
from jaxllm.kv.options import KVLayout
from jaxllm.kv.paged import KindSpec, table_width

GiB = 1024**3


@dataclass(frozen=True)
class PoolPlan:
    """The pools of a model (and its draft model, whose blocks the same tables name): per kind
    name, its blocks (block 0, the null block, included), table width, window and bytes a block
    takes over every layer of every model."""

    layout: KVLayout
    block_size: int
    rows: int  # slots (sequences at once)
    max_len: int  # positions a sequence may reach
    span: int  # positions a call may write past a row's lowest (sliding tables hold them)
    blocks: dict
    widths: dict
    windows: dict
    block_bytes: dict
    per_device: int | None = None  # bytes on the device that holds the most (None: one device)

    @staticmethod
    def kinds(models: list[list[KindSpec]], block_size: int, itemsize: int, max_len: int, span: int):
        """(widths, windows, block bytes) by kind name over the models' pools."""
        windows, block_bytes = {}, {}
        for specs in models:
            for s in specs:
                w = windows.get(s.name, s.window)
                windows[s.name] = None if s.window is None else max(s.window, w or 0)
                block_bytes[s.name] = block_bytes.get(s.name, 0) + s.block_bytes(block_size, itemsize)
        widths = {n: table_width(w, block_size, max_len, span) for n, w in windows.items()}
        return widths, windows, block_bytes

    @classmethod
    def for_rows(
        cls, models, layout: KVLayout, block_size: int, itemsize: int, rows: int, max_len: int, span: int
    ) -> "PoolPlan":
        """Every row its own blocks for `max_len` positions (a lockstep batch)."""
        widths, windows, block_bytes = cls.kinds(models, block_size, itemsize, max_len, span)
        blocks = {n: rows * w + 1 for n, w in widths.items()}
        return cls(layout, block_size, rows, max_len, span, blocks, widths, windows, block_bytes)

    @classmethod
    def for_budget(
        cls,
        models,
        layout: KVLayout,
        block_size: int,
        itemsize: int,
        rows: int,
        max_len: int,
        span: int,
        budget: int,
        steady: int | None = None,
    ) -> "PoolPlan":
        """As many blocks as `budget` bytes hold: sliding kinds the windows of the slots, global
        kinds the rest."""
        widths, windows, block_bytes = cls.kinds(models, block_size, itemsize, max_len, span)
        slid = [n for n, w in windows.items() if w is not None]
        glob = [n for n, w in windows.items() if w is None]
        g_bytes = sum(block_bytes[n] for n in glob)
        seq_g = -(-max_len // block_size) * g_bytes  # a sequence's global KV
        # A decoding sequence's window (and the `steady` positions a call writes past it); a prefill
        # piece holds up to `span` more of its prompt's positions while it is written.
        held = {n: table_width(windows[n], block_size, max_len, steady or span) for n in slid}
        burst = {n: widths[n] - held[n] for n in slid}
        seq_s = sum(held[n] * block_bytes[n] for n in slid)
        extra = sum(burst[n] * block_bytes[n] for n in slid)
        if not glob:
            n = max(1, (budget - extra) // max(seq_s, 1))
            blocks = {k: n * held[k] + burst[k] + 1 for k in slid}
        else:
            # Sliding kinds: every slot's window twice over where the rest still holds every slot at
            # its longest, else once where it holds one sequence, else as many windows as there
            # are sequences the budget holds at their longest. Global kinds: the rest.
            full = max(1, (budget - extra) // max(seq_g + seq_s, 1))
            for windows_for in (2 * rows, rows, min(rows, full)):
                g = (budget - extra - windows_for * seq_s) // max(g_bytes, 1)
                if g * g_bytes >= seq_g * (rows if windows_for == 2 * rows else 1):
                    break
            blocks = {**{k: int(g) for k in glob}, **{k: windows_for * held[k] + burst[k] + 1 for k in slid}}
        blocks = {k: max(2, int(c)) for k, c in blocks.items()}
        return cls(layout, block_size, rows, max_len, span, blocks, widths, windows, block_bytes)

    @property
    def total(self) -> int:
        return sum(self.blocks[n] * self.block_bytes[n] for n in self.blocks)

    @property
    def device_bytes(self) -> int:
        """What one device must find free for its share of the pools."""
        return self.total if self.per_device is None else self.per_device

    def blocks_for(self, name: str, length: int) -> int:
        """Blocks of kind `name` a decoding sequence of `length` positions holds at once."""
        n = -(-length // self.block_size)
        w = self.windows[name]
        return n if w is None else min(n, table_width(w, self.block_size, length, 1))

    @property
    def tokens(self) -> int:
        """Positions of global KV the pool holds (of sliding KV where no kind is global)."""
        glob = [n for n, w in self.windows.items() if w is None] or list(self.blocks)
        return min((self.blocks[n] - 1) * self.block_size for n in glob)

    def sequences(self, length: int) -> int:
        """Sequences of `length` positions the pool holds at once."""
        return min((self.blocks[n] - 1) // max(self.blocks_for(n, length), 1) for n in self.blocks)

    def where(self) -> str:
        return "" if self.device_bytes == self.total else f", {self.device_bytes / GiB:.2f} GiB a device"

    def describe(self) -> str:
        kinds = ", ".join(
            f"{n} {self.blocks[n] - 1:,} blocks ({self.block_bytes[n]:,} bytes each)" for n in sorted(self.blocks)
        )
        return (
            f"KV pool: {self.layout.name}, {self.block_size}-token blocks: {kinds}; "
            f"{self.total / GiB:.2f} GiB{self.where()}; holds {self.tokens:,} tokens, "
            f"{self.sequences(self.max_len):,} sequences of {self.max_len:,}"
        )


def per_device_bytes(shapes) -> int:
    """Bytes the device holding the most of a tree of sharded shape structs holds."""
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize for s in jax.tree_util.tree_leaves(shapes))


def free_memory(device=None) -> int | None:
    """Bytes the device can still allocate: the allocator's limit less what is in use; on a CPU
    without allocator statistics, the host's available memory."""
    device = device or jax.local_devices()[0]
    stats = device_stats(device)
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def device_stats(device) -> dict | None:
    try:
        return device.memory_stats()
    except Exception:  # some backends do not implement memory statistics
        return None


def check_fits(plan: PoolPlan, device=None, free: int | None = None):
    """A clear error where a device cannot hold its share of the pools."""
    free = free_memory(device) if free is None else free
    if free is not None and plan.device_bytes > free:
        raise RequestError(
            f"the KV cache for {plan.rows} x {plan.max_len:,} tokens needs "
            f"{plan.total / GiB:.2f} GiB ({plan.layout.name}{plan.where()}) but only "
            f"{free / GiB:.2f} GiB of device memory is free; lower --max-ctx or --batch, "
            f"or use --kv-quant int8"
        )


def report(plan: PoolPlan, file=None):
    print(plan.describe(), file=file or sys.stderr)
