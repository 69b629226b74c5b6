"""The scheduler's KV memory: which requests may take a slot, the blocks each call's rows need, the
prefix cache's hits and entries, and preemption. `Memory` is the half of `Scheduler` that does this
(the scheduler holds the state it uses: the core and its `BlockManager`, the slots, the queue).

A queued request takes a slot once the blocks its prompt needs past its cached prefix are free
(or held by cached prefixes nobody uses, which are evicted), so a long prompt waits rather than
pushing running requests out. Running requests take blocks call by call; when none is left, the
newest running request is preempted: its blocks are released (its full blocks to the prefix cache),
and it goes back to the head of the queue with the tokens it had sampled, which its next prefill
computes again (mostly from the prefix cache) before it samples on, as the same request would
have: its sampling step, penalty counts and grammar go on from where they were. None is lost.

A request takes no prefix from the cache where the cached positions would lose something it
asks of the prompt: its tokens scored (`echo` with log-probabilities) or counted by a penalty
(`_reusable`). Its blocks still enter the cache for the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from jaxllm.engine.blocks import Hit, block_hashes
from jaxllm.engine.jobs import Job

log = logging.getLogger("jaxllm.engine")


@dataclass(frozen=True)
class KVMemory:
    """The scheduler's KV pool: `size` bytes, or (None) `utilization` of the memory the device's
    allocator may use, less what is in use (the weights) and what the calls' own buffers need
    (where the device says what it has; elsewhere room for every slot at its longest); whether
    it caches prefixes (vLLM's `--gpu-memory-utilization`, `--kv-cache-memory-bytes`,
    `--enable-prefix-caching`)."""

    utilization: float = 0.9
    size: int | None = None
    prefix_caching: bool = True
    every_slot: bool = False  # room for every slot at its longest, whatever the device has


def deterministic_memory(memory: KVMemory) -> KVMemory:
    """The pool of a deterministic server: no prefix reuse (a hit starts a prompt's pieces at the
    hit, not at the offsets it has alone) and room for every slot at its longest (a preempted
    request's sampled tokens would be prefilled again, in other arithmetic than their decode
    steps), where no size is given."""
    return replace(memory, prefix_caching=False, every_slot=memory.size is None)


class Memory:
    # -- taking a slot ---------------------------------------------------------------------------------
    def _reusable(self, job: Job) -> int:
        """How many of `job`'s prompt tokens it may take from the prefix cache: none where their
        scores or their repetition penalty are asked; of a request computed again after a
        preemption with presence or frequency penalties, not the tokens it had sampled (the
        penalties count those as its prefill reads them)."""
        r = job.req
        if r.scores_prompt or r.repetition_penalty != 1.0:
            return 0
        if r.presence_penalty or r.frequency_penalty:
            return len(r.prompt_ids)
        return len(job.prompt)

    def _fits(self, job: Job) -> Hit | None:
        """`job`'s cached prefix where its prompt (and its other answers' first blocks) fit the
        blocks free now, else None."""
        b = self.core.blocks
        prompt = job.prompt
        hit = b.lookup(prompt[: self._reusable(job) + 1])
        need = b.needed(hit.tokens, len(prompt) + 1, hit.blocks)
        others = 0 if job.resumed else len(job.children)
        for n, k in b.kinds.items():
            unheld = sum(1 for blk in hit.blocks[n].values() if k.refs[blk] == 0)
            if k.available - unheld < need[n] + 2 * others:
                return None
        return hit

    def _seat(self, job: Job, slot: int, hit: Hit | None):
        """`job` takes `slot`, holding the blocks of its cached prefix (its other answers fork it)."""
        job.slot, job.started, job.launched, job.sent = slot, False, 0, False
        self.admissions += 1
        job.admitted = self.admissions
        self._take_prefix(job, hit)
        if hit is not None:
            b = self.core.blocks
            job.hashes = block_hashes(job.prompt, b.block_size, len(job.prompt) // b.block_size)

    def _take_prefix(self, job: Job, hit: Hit | None):
        b = self.core.blocks
        if b.seqs[job.slot] is not None:
            b.release(job.slot)
        b.admit(job.slot, hit)
        job.prefilled = job.start_at = 0 if hit is None else hit.tokens
        if job.start_at and self.engine.spec is not None:  # n-gram drafts read the whole prompt
            with self._device_call("history"):
                self.core.seed_history(job.slot, job.prompt)

    def _held_back(self) -> set:
        """Prompts that have sent nothing and whose next block an earlier prompt waiting for its
        prefill will compute (the same tokens, and the same before them): they wait for it, then
        take it from the prefix cache (`_refresh`), so a burst of requests with one system prompt
        computes it once."""
        P = self.core.blocks.block_size
        pending, held = {}, set()
        for job in self.prefilling:
            if not job.sent:
                b = job.start_at // P
                if (
                    b < len(job.hashes)
                    and (b + 1) * P <= self._reusable(job)
                    and pending.get(job.hashes[b], job) is not job
                ):
                    held.add(job)
                    continue
            for h in job.hashes[job.prefilled // P :]:
                pending.setdefault(h, job)
        return held

    def _refresh(self, job: Job):
        """A prompt about to send its first piece takes the longest cached prefix there is now:
        other prompts' blocks may have joined the cache since it took its slot. Its lookup counts
        then (what its answer reports as cached)."""
        b = self.core.blocks
        if b.prefix_caching:
            hit = b.lookup(job.prompt[: self._reusable(job) + 1])
            if hit.tokens > job.start_at:
                self._take_prefix(job, hit)
        job.sent = True
        if job.cached is None:
            job.cached = job.start_at
            b.count_lookup(len(job.prompt), job.start_at)
            self.observer.prefix(len(job.prompt), job.start_at)

    # -- blocks for a call ---------------------------------------------------------------------------
    def _take_blocks(self, job: Job, lo: int, hi: int) -> bool:
        """`job`'s slot holds blocks for positions up to hi (queries from lo on), newer decoding
        requests preempted while the pool has too few. -> False where even that was not enough."""
        hi = min(hi, self.core.max_len)
        while not self.core.blocks.allocate(job.slot, lo, hi):
            victim = self._victim(job)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _victim(self, keep: Job) -> Job | None:
        """The request to preempt for `keep`: the newest decoding one admitted after it."""
        cands = [j for j in self._decoding() if j is not keep and j.admitted > keep.admitted]
        return max(cands, key=lambda j: j.admitted, default=None)

    def _decode_blocks(self, jobs: list[Job], tokens: int) -> list[Job]:
        """Blocks for a decode call of `tokens` positions a row over `jobs` (the oldest first, the
        newest preempted where blocks run out). -> the jobs still decoding."""
        plan = self.core.plan
        # a sliding kind's table holds the window and `span` positions past it
        span = plan.span if any(w is not None for w in plan.windows.values()) else None
        for job in sorted(jobs, key=lambda j: j.admitted):
            if job.slot < 0:  # preempted for an older one
                continue
            lo, hi = self._positions(job, tokens)
            if span is not None and hi - lo > span:  # the calls in flight ran ahead: their tokens first
                self._await_results()
                lo, hi = self._positions(job, tokens)
            if job.done or job.slot < 0:
                continue
            if not self._take_blocks(job, lo, hi):
                self._preempt(job)
        return [j for j in self._decoding() if j.launched < j.req.max_tokens]

    def _positions(self, job: Job, tokens: int) -> tuple[int, int]:
        """(lowest position a query of the job's next call may be at, one past the highest it may
        write): its last token read back is the lowest it may feed; the calls launched may have
        sampled `launched` tokens past its prompt."""
        L = len(job.prompt)
        read = len(job.out_ids) - job.resumed
        return L + max(read - 1, 0), min(L + job.launched + tokens, len(job.req.prompt_ids) + job.req.max_tokens)

    def _fork_blocks(self, child: Job) -> dict | None:
        """`child`'s slot shares its parent's prompt blocks (`BlockManager.fork`), newer decoding
        requests preempted for the block it copies where none is free. -> the copies, or None."""
        b = self.core.blocks
        while True:
            copies = b.fork(child.parent.slot, child.slot, len(child.req.prompt_ids))
            victim = None if copies is not None else self._victim(child.parent)
            if victim is None:
                return copies
            self._preempt(victim)

    # -- giving blocks back ------------------------------------------------------------------------
    def _release(self, job: Job):
        """`job`'s slot gives its blocks back, the full ones of tokens known into the prefix cache."""
        seq = job.prompt + job.out_ids[job.resumed :]
        written = len(job.prompt) + max(len(job.out_ids) - job.resumed - 1, 0) if job.started else job.prefilled
        self.core.blocks.release(job.slot, seq, written)

    def _preempt(self, job: Job):
        """Take `job` off its slot and back to the head of the queue, to be prefilled again with
        the tokens it had sampled (every call launched for it read back first)."""
        self._await_results()
        if job.slot < 0:
            return
        if job.done or job.cancelled.is_set():  # it ended meanwhile: its slot is free for the taking
            job.end(None)
            self._free(job)
            return
        log.info("preempting request %s (%d tokens sampled) for KV blocks", job.req.id, len(job.out_ids))
        self.preemptions += 1
        self.observer.preempted()
        self.ahead = None  # a forward launched ahead no longer matches the slots
        self._free(job, keep=True)
        job.resumed = len(job.out_ids)
        self._requeue(job)

    def _unseat(self, job: Job):
        """Take `job`, which has not started decoding, off its slot and back to the head of the queue
        (its other answers, waiting to fork it, give their slots back too)."""
        for c in job.children if not job.resumed else ():
            if not c.started and c.slot >= 0:
                self._free(c, keep=True)
                c.slot = -1
        self._free(job, keep=True)
        self._requeue(job)

    def _requeue(self, job: Job):
        job.slot, job.prefilled, job.started, job.launched, job.sent = -1, 0, False, 0, False
        with self.cond:
            self.waiting.appendleft(job)
            self.cond.notify()
