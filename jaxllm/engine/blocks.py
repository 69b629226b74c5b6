"""The block allocator and the prefix cache: which KV blocks each slot (a sequence) holds, on the host.

Each attention kind has a pool of blocks (`kv.paged`); block 0 is the null block, never handed out.
A block is free, held (its reference count is the slots whose tables name it), or cached: full of
keys and values of known tokens, indexed by a hash of those tokens and of every token before them,
held by no slot, and reused by the next sequence that starts with the same tokens. Cached blocks
are evicted least recently released first, when no free block is left.

A sequence's logical block j holds positions [j * P, (j + 1) * P) and sits at column j % width of
its table. Global kinds' tables hold every logical block; a sliding kind's only those from the
first position a query still sees (`floor`) on: as a sequence advances, the blocks behind its
window are released (to the prefix cache where their tokens are known), and the column takes the
new logical block's fresh block. A prefix hit therefore needs, for sliding kinds, only the blocks
of the window before the hit, and seeds it: Gemma's sliding layers get hits as Qwen3's layers do.

A block is registered in the prefix cache once the calls that write its keys and values have all
been launched (`commit`): the device runs calls in order, so a later request's call that reads it
runs after them. Nothing is written into a registered block again: a sequence writes only its own
positions, past every full block it shares.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

NULL = 0


def block_hashes(tokens, block_size: int, n: int, parent: int = 0, start: int = 0) -> list[int]:
    """The chained hashes of logical blocks start.. start + n of `tokens` (the hash before block
    `start` is `parent`)."""
    out = []
    for j in range(start, start + n):
        parent = hash((parent, tuple(tokens[j * block_size : (j + 1) * block_size])))
        out.append(parent)
    return out


@dataclass
class Kind:
    """One attention kind's blocks."""

    name: str
    num_blocks: int
    width: int
    window: int | None
    refs: np.ndarray = None
    free: collections.deque = None
    cached: dict = field(default_factory=dict)  # hash -> block
    hash_of: dict = field(default_factory=dict)  # block -> hash (blocks in the prefix cache)
    evictable: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # cached, unheld: LRU

    def __post_init__(self):
        self.refs = np.zeros(self.num_blocks, np.int32)
        self.free = collections.deque(range(1, self.num_blocks))

    @property
    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def take(self) -> int | None:
        """A block to write: a free one, else the least recently released cached one."""
        if self.free:
            b = self.free.popleft()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(b)]
        else:
            return None
        self.refs[b] = 1
        return b

    def hold(self, b: int):
        if self.refs[b] == 0:
            self.evictable.pop(b, None)
        self.refs[b] += 1

    def release(self, b: int):
        if b == NULL:
            return
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.hash_of:
                self.evictable[b] = None
            else:
                self.free.append(b)

    def register(self, b: int, h: int):
        """Block b holds the tokens of hash h (a block of the same tokens cached already stays so)."""
        if b != NULL and h not in self.cached and b not in self.hash_of:
            self.cached[h] = b
            self.hash_of[b] = h

    def floor(self, lo: int, block_size: int) -> int:
        """The first logical block a query at or after position lo still sees."""
        return 0 if self.window is None else max(0, lo - self.window + 1) // block_size


@dataclass
class Seq:
    """What a slot holds: per kind, logical block -> block (logical blocks [first, end) of the kind,
    `held`); the tokens whose blocks are hashed."""

    blocks: dict  # kind name -> {logical block: block}
    held: dict = field(default_factory=dict)  # kind name -> [first, end)
    hashes: list = field(default_factory=list)  # chained hashes of its full, registered blocks

    def hold(self, name: str, j: int, b: int):
        self.blocks[name][j] = b
        first, end = self.held.get(name, (j, j))
        self.held[name] = (min(first, j), max(end, j + 1))


@dataclass
class Hit:
    """A prefix found in the cache: its first `tokens` positions, and the blocks of each kind (by
    logical block) that hold them."""

    tokens: int
    blocks: dict
    hashes: list


class BlockManager:
    """The blocks of every kind and the slots' block tables (numpy, [slots, width] per kind, which
    the engine puts on the device when they change)."""

    def __init__(self, plan, rows: int, prefix_caching: bool = True):
        self.block_size = plan.block_size
        self.kinds = {n: Kind(n, plan.blocks[n], plan.widths[n], plan.windows[n]) for n in plan.blocks}
        self.tables = {n: np.zeros((rows, k.width), np.int32) for n, k in self.kinds.items()}
        self.seqs: list[Seq | None] = [None] * rows
        self.prefix_caching = prefix_caching
        self.version = 0  # bumped whenever a table changes
        self.queries = self.hits = 0  # prompt tokens looked up in the prefix cache, and found

    # -- what there is -----------------------------------------------------------------------------
    def usage(self) -> float:
        """The fraction of blocks held by sequences (cached blocks nobody holds count as free)."""
        used = sum(k.num_blocks - 1 - k.available for k in self.kinds.values())
        return used / max(sum(k.num_blocks - 1 for k in self.kinds.values()), 1)

    def needed(self, lo: int, hi: int, have: dict | None = None) -> dict:
        """Blocks of each kind a sequence must take to write positions [.., hi) with queries from lo
        on, beyond those it has ({kind: {logical block: block}})."""
        P, out = self.block_size, {}
        for n, k in self.kinds.items():
            held = (have or {}).get(n, {})
            out[n] = min(sum(1 for j in range(k.floor(lo, P), -(-hi // P)) if j not in held), k.width)
        return out

    def can_take(self, need: dict) -> bool:
        return all(self.kinds[n].available >= c for n, c in need.items())

    # -- sequences -----------------------------------------------------------------------------------
    def lookup(self, tokens) -> Hit:
        """The longest cached prefix of `tokens` whose blocks every kind holds, leaving at least
        the last token to compute (its logits draw the first new token)."""
        P = self.block_size
        n = (len(tokens) - 1) // P if self.prefix_caching else 0
        hashes = block_hashes(tokens, P, n)
        glob = [k for k in self.kinds.values() if k.window is None]
        j = n
        for k in glob:
            j = next((i for i, h in enumerate(hashes[:j]) if h not in k.cached), j)
        while j > 0:
            if all(
                hashes[i] in k.cached
                for k in self.kinds.values()
                if k.window is not None
                for i in range(k.floor(j * P, P), j)
            ):
                break
            j -= 1
        blocks = {name: {i: k.cached[hashes[i]] for i in range(k.floor(j * P, P), j)} for name, k in self.kinds.items()}
        return Hit(j * P, blocks, hashes[:j])

    def admit(self, row: int, hit: Hit | None = None):
        """Slot `row` starts a sequence holding the blocks of `hit` (a prefix found by `lookup`)."""
        assert self.seqs[row] is None, f"slot {row} is held"
        seq = Seq({n: {} for n in self.kinds})
        self.seqs[row] = seq
        if hit is None:
            return
        for n, blocks in hit.blocks.items():
            k = self.kinds[n]
            for j, b in blocks.items():
                k.hold(b)
                seq.hold(n, j, b)
                self.tables[n][row, j % k.width] = b
        seq.hashes = list(hit.hashes)
        self.version += 1

    def allocate(self, row: int, lo: int, hi: int) -> bool:
        """Slot `row` holds blocks for positions [.., hi) with queries from position lo on: the
        sliding kinds' blocks behind the window are released, missing blocks taken. -> False where
        a kind ran out of blocks (what was taken is kept; nothing else changes)."""
        seq, P = self.seqs[row], self.block_size
        top = -(-hi // P)
        for n, k in self.kinds.items():
            have, table = seq.blocks[n], self.tables[n][row]
            floor = k.floor(lo, P)
            first, end = seq.held.get(n, (floor, floor))
            if first < floor:  # behind the window: released
                for j in range(first, min(floor, end)):
                    k.release(have.pop(j))
                    if j + k.width >= end:  # no newer block of the row took its column
                        table[j % k.width] = NULL
                first, end = (floor, end) if floor < end else (floor, floor)
                seq.held[n] = (first, end)
                self.version += 1
            for j in range(max(end, floor), top):
                assert j - k.width not in have, f"{n} blocks {j - k.width} and {j} share a column: a span too short"
                b = k.take()
                if b is None:
                    return False
                seq.hold(n, j, b)
                table[j % k.width] = b
                self.version += 1
        return True

    def commit(self, row: int, tokens, written: int):
        """Register in the prefix cache the full blocks of slot `row` whose positions below
        `written` the launched calls write (`tokens`: the sequence's tokens, at least that many)."""
        if not self.prefix_caching:
            return
        seq, P = self.seqs[row], self.block_size
        n = min(written, len(tokens)) // P
        if n <= len(seq.hashes):
            return
        start = len(seq.hashes)
        seq.hashes += block_hashes(tokens, P, n - start, seq.hashes[-1] if seq.hashes else 0, start)
        for name, k in self.kinds.items():
            for j in range(start, n):
                b = seq.blocks[name].get(j)
                if b is not None:
                    k.register(b, seq.hashes[j])

    def fork(self, src: int, dst: int, length: int) -> dict:
        """Slot `dst` starts a sequence sharing slot `src`'s blocks of positions [0, length): the
        full ones held by both, the last partial one copied into a block of dst's own. -> the
        copies {kind: [(src block, dst block)]}, or None where a kind ran out of blocks."""
        s, P = self.seqs[src], self.block_size
        partial = {n: [j for j in s.blocks[n] if j * P < length < (j + 1) * P] for n in self.kinds}
        if any(self.kinds[n].available < len(js) for n, js in partial.items()):
            return None
        if self.seqs[dst] is None:
            self.admit(dst)
        d = self.seqs[dst]
        copies = {}
        for n, k in self.kinds.items():
            copies[n] = []
            for j, b in sorted(s.blocks[n].items()):
                if (j + 1) * P <= length:
                    k.hold(b)
                    d.hold(n, j, b)
                elif j * P < length:
                    nb = k.take()
                    copies[n].append((b, nb))
                    d.hold(n, j, nb)
                else:
                    continue
                self.tables[n][dst, j % k.width] = d.blocks[n][j]
        d.hashes = list(s.hashes[: length // P])
        self.version += 1
        return copies

    def release(self, row: int, tokens=None, written: int = 0):
        """Slot `row`'s sequence ends: its full blocks whose tokens are known (the first `written`
        positions of `tokens`) go to the prefix cache, the others are freed."""
        if self.seqs[row] is None:
            return
        if tokens is not None:
            self.commit(row, tokens, written)
        for n, k in self.kinds.items():
            for b in self.seqs[row].blocks[n].values():
                k.release(b)
            self.tables[n][row] = NULL
        self.seqs[row] = None
        self.version += 1

    def reset(self):
        """Everything freed, the prefix cache emptied (after a failed device call lost the pools)."""
        rows = len(self.seqs)
        for n, k in self.kinds.items():
            self.kinds[n] = Kind(n, k.num_blocks, k.width, k.window)
            self.tables[n] = np.zeros((rows, k.width), np.int32)
        self.seqs = [None] * rows
        self.version += 1

    def count_lookup(self, prompt_tokens: int, hit_tokens: int):
        self.queries += prompt_tokens
        self.hits += hit_tokens
