"""The scheduler's seats: the requests that hold its slots and the KV blocks behind them, and those
queued for one (`Seats`); the size of its KV pool (`KVMemory`).

A queued request takes a slot once the blocks its prompt needs past its cached prefix are free
(or held by cached prefixes nobody uses, which are evicted), so a long prompt waits rather than
pushing running requests out. Running requests take blocks call by call; when none is left, the
newest running request is preempted: its blocks are released (its full blocks to the prefix cache),
and it goes back to the head of the queue with the tokens it had sampled, which its next prefill
computes again (mostly from the prefix cache) before it samples on, as the same request would
have: its sampling step, penalty counts and grammar go on from where they were. None is lost.

A request takes no prefix from the cache where the cached positions would lose something it
asks of the prompt: its tokens scored (`echo` with log-probabilities) or counted by a penalty
(`Seats._reusable`). Its blocks still enter the cache for the others.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from jaxllm.engine.blocks import Hit, block_hashes
from jaxllm.engine.detok import TextStream
from jaxllm.engine.jobs import Failed, Job

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


class Seats:
    """The requests the scheduler holds: queued (`waiting`, which the request handlers append to),
    in a slot (`slots`), and of those the ones whose prompts wait for their prefill (`prefilling`);
    the slots to stop on the device at the next decode (`to_stop`). `waiting` and `slots` change
    under the scheduler's `cond`; the rest is the engine thread's, as are the methods.

    `core`: the scheduler's engine core (its `BlockManager`, plan and longest sequence);
    `await_results()`: wait until the output thread has read back every call launched (a request's
    tokens so far, before it is preempted or its blocks are counted from them); `preempted()`: a
    running request was just preempted; `seed_history(job)`: a request that takes a cached prefix
    seeds its drafting history (None: no speculation)."""

    def __init__(
        self,
        core,
        cond: threading.Condition,
        *,
        await_results: Callable[[], None],
        preempted: Callable[[], None],
        seed_history: Callable[[Job], None] | None = None,
    ):
        self.core, self.cond = core, cond
        self.await_results, self.preempted, self.seed_history = await_results, preempted, seed_history
        self.slots: list[Job | None] = [None] * core.num_slots
        self.to_stop = np.zeros(core.num_slots, bool)
        self.prefilling: list[Job] = []  # admitted, prompt not all sent
        self.waiting: collections.deque[Job] = collections.deque()
        self.admissions = self.preemptions = 0
        self.freed = 0  # slots given back so far

    def busy(self) -> bool:
        return any(j is not None for j in self.slots)

    def decoding(self) -> list[Job]:
        """The jobs whose slots decode: their first tokens drawn."""
        return [j for j in self.slots if j is not None and j.started]

    def to_decode(self) -> list[Job]:
        """The decoding jobs that the calls launched so far do not take to their token limit: a
        round of requests that end together leaves no block running on empty rows after them."""
        return [j for j in self.decoding() if j.launched < j.req.max_tokens]

    # -- taking a slot ---------------------------------------------------------------------------------
    def admit(self, tokenizer):
        """Give free slots (the lowest first, so live requests stay in the leading slots) to queued
        requests whose prompts' KV blocks fit (`_fits`), a slot for each of a request's answers (one
        for an answer preempted, which no longer shares its request's prompt); their prompts then
        wait for prefill, from the end of the prefix found cached. A slot's earlier request, if
        still live on the device, is stopped there until the new one starts (`to_stop`, cleared
        when the slot's first token is drawn). `tokenizer`: what turns their tokens into text."""
        while True:
            free = [b for b, j in enumerate(self.slots) if j is None]
            got = self._next_waiting(len(free))
            if got is None:
                return
            job, hit = got
            for c, b in zip([job] if job.resumed else job.choices, free):
                if c.text is None:
                    c.text = TextStream(tokenizer, c.req.stop, c.req.skip_special, c.req.include_stop)
                self._seat(c, b, hit if c is job else None)
                with self.cond:
                    self.slots[b] = c
            self.prefilling.append(job)

    def _next_waiting(self, free: int):
        """The first queued request and its cached prefix, if its answers fit `free` slots and its
        prompt the free KV blocks (else it waits, and the requests behind it with it)."""
        with self.cond:
            while self.waiting:
                job = self.waiting[0]
                if job.cancelled.is_set():
                    self.waiting.popleft()
                    continue
                if (1 if job.resumed else len(job.choices)) > free:
                    return None
                break
            else:
                return None
        hit = self._fits(job)
        if hit is None and not self.busy():  # the pool is as free as it gets: it never will fit
            with self.cond:
                if not self.waiting or self.waiting[0] is not job:
                    return None
                self.waiting.popleft()
            why = (
                f"the request's prompt of {len(job.prompt)} tokens and its {len(job.choices)} answers need more "
                f"KV blocks than the server's whole pool holds; send fewer answers ('n') or a shorter prompt"
            )
            for c in job.choices:
                c.end(Failed(400, why, type="invalid_request_error"))
            return None
        with self.cond:
            if hit is None or not self.waiting or self.waiting[0] is not job:
                return None
            return self.waiting.popleft(), hit

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
        if job.start_at and self.seed_history is not None:  # n-gram drafts read the whole prompt
            self.seed_history(job)

    def held_back(self) -> set:
        """Prompts that have sent nothing and whose next block an earlier prompt waiting for its
        prefill will compute (the same tokens, and the same before them): they wait for it, then
        take it from the prefix cache (`refresh`), so a burst of requests with one system prompt
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

    def refresh(self, job: Job) -> bool:
        """A prompt about to send its first piece takes the longest cached prefix there is now:
        other prompts' blocks may have joined the cache since it took its slot. Its lookup counts
        then (what its answer reports as cached). -> whether this was that lookup."""
        b = self.core.blocks
        if b.prefix_caching:
            hit = b.lookup(job.prompt[: self._reusable(job) + 1])
            if hit.tokens > job.start_at:
                self._take_prefix(job, hit)
        job.sent = True
        if job.cached is not None:
            return False
        job.cached = job.start_at
        b.count_lookup(len(job.prompt), job.start_at)
        return True

    def start(self, job: Job):
        """`job`'s first token is drawn by a call just launched: its slot decodes from now on."""
        job.started = True
        job.launched = 1
        self.to_stop[job.slot] = False

    # -- blocks for a call ---------------------------------------------------------------------------
    def take_blocks(self, job: Job, lo: int, hi: int) -> bool:
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
        cands = [j for j in self.decoding() if j is not keep and j.admitted > keep.admitted]
        return max(cands, key=lambda j: j.admitted, default=None)

    def decode_blocks(self, jobs: list[Job], tokens: int) -> list[Job]:
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
                self.await_results()
                lo, hi = self._positions(job, tokens)
            if job.done or job.slot < 0:
                continue
            if not self.take_blocks(job, lo, hi):
                self._preempt(job)
        return self.to_decode()

    def _positions(self, job: Job, tokens: int) -> tuple[int, int]:
        """(lowest position a query of the job's next call may be at, one past the highest it may
        write): its last token read back is the lowest it may feed; the calls launched may have
        sampled `launched` tokens past its prompt."""
        L = len(job.prompt)
        read = len(job.out_ids) - job.resumed
        return L + max(read - 1, 0), min(L + job.launched + tokens, len(job.req.prompt_ids) + job.req.max_tokens)

    def fork_blocks(self, child: Job) -> dict | None:
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
    def free(self, job: Job, keep: bool = False):
        """Give a request's slot and KV blocks back; `keep`: its grammar too, as it goes on later
        (preempted)."""
        if job.slot >= 0 and self.slots[job.slot] is job:
            self._release(job)
            with self.cond:
                self.slots[job.slot] = None
            self.to_stop[job.slot] = True
            self.freed += 1
        if not keep:
            job.matcher = None
        if job in self.prefilling:
            self.prefilling.remove(job)

    def _release(self, job: Job):
        """`job`'s slot gives its blocks back, the full ones of tokens known into the prefix cache."""
        seq = job.prompt + job.out_ids[job.resumed :]
        written = len(job.prompt) + max(len(job.out_ids) - job.resumed - 1, 0) if job.started else job.prefilled
        self.core.blocks.release(job.slot, seq, written)

    def _preempt(self, job: Job):
        """Take `job` off its slot and back to the head of the queue, to be prefilled again with
        the tokens it had sampled (every call launched for it read back first)."""
        self.await_results()
        if job.slot < 0:
            return
        if job.done or job.cancelled.is_set():  # it ended meanwhile: its slot is free for the taking
            job.end(None)
            self.free(job)
            return
        log.info("preempting request %s (%d tokens sampled) for KV blocks", job.req.id, len(job.out_ids))
        self.preemptions += 1
        self.preempted()
        self.free(job, keep=True)
        job.resumed = len(job.out_ids)
        self._requeue(job)

    def unseat(self, job: Job):
        """Take `job`, which has not started decoding, off its slot and back to the head of the queue
        (its other answers, waiting to fork it, give their slots back too)."""
        for c in job.children if not job.resumed else ():
            if not c.started and c.slot >= 0:
                self.free(c, keep=True)
                c.slot = -1
        self.free(job, keep=True)
        self._requeue(job)

    def _requeue(self, job: Job):
        job.slot, job.prefilled, job.started, job.launched, job.sent = -1, 0, False, 0, False
        with self.cond:
            self.waiting.appendleft(job)
            self.cond.notify()
