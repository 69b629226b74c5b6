"""The scheduler's output thread: each device call's results, read back in launch order, become the
requests' events (text deltas, log-probabilities, prompt scores, their ends).

The engine thread launches calls and hands a `Launched` for each to the `ResultReader`, whose
thread reads its tokens back, has each constrained request's grammar take its tokens, turns them
into text (stop strings, EOS, token limits) and sends the events, once per request whichever thread
ends it first (`Job.end`). In the one-step blocks of constrained decoding a row's tokens are held
back and sent a block's worth at a time (`ResultReader._hold`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import jax
import numpy as np

from jaxllm.engine.jobs import Delta, Failed, Finished, Job, Observer, Prompt
from jaxllm.engine.outputs import TokenLogprob, token_logprobs

log = logging.getLogger("jaxllm.engine")


@dataclass
class Launched:
    """A device call whose results the host has not read yet, and what the slots held then."""

    kind: str  # "prefill" | "decode"
    result: object
    jobs: list  # prefill: the job of each piece; decode: the job of each slot
    finals: list | None = None  # prefill: whether each piece ended its prompt
    scored: list | None = None  # prefill: (start, length) of each piece whose tokens were scored, or None
    record: dict | None = None  # this call's entry in `Scheduler.record`
    hold: bool = False  # decode: a one-step block whose tokens the jobs hold back (`_hold`)


class ResultReader:
    """The output thread's work: the calls handed to it (`put`, at most two waiting), read back in
    order (`run`, the thread's loop).

    `get`: a call's results on the host (`Layout.get`); `eos`: the model's end-of-sequence ids;
    `decode_steps`: a decode block's steps, the tokens a row holds back at most; `cond`: the
    scheduler's condition, under which `read` counts the calls read back; `on_end(job, complete)`:
    this thread sent a job's last events (`complete`: its request's last answer), so its slot may be
    given back; `on_failure(error)`: the loop itself failed, nothing more will be read."""

    def __init__(
        self,
        get: Callable,
        eos: Iterable[int],
        decode_steps: int,
        cond: threading.Condition,
        on_end: Callable[[Job, bool], None],
        on_failure: Callable[[BaseException], None],
    ):
        self.get = get
        self.eos = set(eos)
        self.decode_steps = decode_steps
        self.cond = cond
        self.on_end, self.on_failure = on_end, on_failure
        self.observer = Observer()  # the scheduler's
        self.calls: queue.Queue[Launched | None] = queue.Queue(maxsize=2)
        self.read = 0  # calls read back
        self.finished = 0  # requests completed
        self.generated = 0  # tokens sampled for requests (a freed slot stops adding)
        self.progress_at = time.monotonic()  # when it last took up a call

    def put(self, call: Launched):
        """Hand a launched call over (waits while two are waiting)."""
        self.calls.put(call)

    def close(self):
        """No more calls: the thread ends once it has read those handed over."""
        self.calls.put(None)

    def run(self):
        """The output thread's loop. Its time: "idle" (no call launched to read), "device" (a call
        launched, the device still running it), "processing" (its results read back and handed out)."""
        try:
            self._read_loop()
        except BaseException as e:  # a bug outside one call's results: nothing more is read
            log.exception("the output thread failed")
            self.on_failure(e)

    def _read_loop(self):
        while True:
            with self.observer.timed("output", "idle"):
                call = self.calls.get()
            if call is None:
                return
            self.progress_at = time.monotonic()
            try:
                with self.observer.timed("output", "device"):
                    jax.block_until_ready(call.result)
                with self.observer.timed("output", "processing"):
                    self._collect(call)
            except Exception:  # the call failed on the device: its requests fail
                log.exception("reading a device call's results failed")
                for job in call.jobs:
                    if job is not None and job.end(Failed(500, "internal error while generating; see the server log")):
                        self.on_end(job, False)
            finally:
                with self.cond:
                    self.read += 1
                    self.cond.notify_all()

    def _collect(self, call: Launched):
        """Hand a call's tokens to the requests that held the slots when it was launched."""
        get = self.get
        if not any(j is not None and j.req.logprobs is not None for j in call.jobs):
            call.result = _without_logprobs(call.kind, call.result)  # left on the device
        if call.kind == "fork":
            res = call.result if isinstance(call.result, tuple) else (call.result, None)
            first, lp = jax.tree_util.tree_map(get, res)
            for f, job in enumerate(call.jobs):
                if job.done:
                    continue
                if job.req.echo or job.req.scores_prompt:  # the prompt's scores, as its parent read them
                    job.emit(Prompt(job.parent.prompt_logprobs if job.req.scores_prompt else None))
                self._take(job, [int(first[f])], _row(lp, f, None))
            return
        if call.kind == "prefill":
            res = call.result if isinstance(call.result, tuple) else (call.result, None)
            first, lp, scores = jax.tree_util.tree_map(get, res + (None,) * (3 - len(res)))
            C = len(scores.token) // len(first) if scores is not None else 0
            for i, job in enumerate(call.jobs):
                if job.done:
                    continue
                if call.scored[i] is not None:
                    self._score_prompt(job, scores, i * C, *call.scored[i])
                if call.finals[i]:
                    if job.req.echo or job.req.scores_prompt:
                        job.emit(Prompt(job.prompt_logprobs if job.req.scores_prompt else None))
                    self._take(job, [int(first[i])], _row(lp, i, None))
            return
        toks, count, lp = (None if x is None else jax.tree_util.tree_map(get, x) for x in call.result)
        for b, job in enumerate(call.jobs):
            if job is not None and count[b] and not job.done:
                call.record["tokens"][job.id] = int(count[b])
                (self._hold if call.hold else self._take)(job, toks[b, : count[b]].tolist(), _row(lp, b, count[b]))

    def _score_prompt(self, job: Job, scores, at: int, start: int, length: int):
        """Fold in the log-probabilities of a prompt piece's next tokens (flat rows at.. of scores)."""
        ids = job.prompt
        if start == 0:
            job.prompt_logprobs = [TokenLogprob(ids[0], None, [])]
        nxt = ids[start + 1 : start + length + 1]
        piece = jax.tree_util.tree_map(lambda a: a[at : at + len(nxt)][None], scores)
        job.prompt_logprobs += token_logprobs(piece, 0, nxt, job.req.prompt_logprobs)

    def _follow(self, job: Job, toks: list[int]) -> tuple[list[int], bool] | None:
        """`job`'s grammar takes its new tokens: -> (those it took, whether it is complete), or None
        where it refused one (the request then fails). What it took joins the job's tokens."""
        if job.matcher is None or not toks:
            job.out_ids += toks
            return toks, False
        try:
            n, complete = job.matcher.follow(toks)
        except ValueError as e:  # its grammar went past llguidance's limits or into a dead end
            why = (str(e).splitlines() or [""])[0][:300]
            log.info("request %s: structured output failed: %s", job.req.id, why)
            if job.end(Failed(400, f"structured output failed: {why}", type="invalid_request_error")):
                self.on_end(job, False)
            return None
        job.out_ids += toks[:n]
        return toks[:n], complete

    def _hold(self, job: Job, toks: list[int], lp=None):
        """A one-step block's tokens for `job`, held back until a block's worth (`decode_steps`) is
        there or the answer may end: its grammar takes them now (the next step's mask needs that),
        their text and events wait, so that a step of one token costs the host a fraction of a
        block's work."""
        r = job.req
        followed = self._follow(job, toks[: r.max_tokens - job.n_tokens - len(job.held)])
        if followed is None:
            return
        toks, complete = followed
        job.held += toks
        job.held_lp.append(None if lp is None else jax.tree_util.tree_map(lambda a: a[:, : len(toks)], lp))
        ends = set(r.stop_token_ids) | (set() if r.ignore_eos else self.eos)
        if (
            complete
            or len(job.held) >= self.decode_steps
            or job.n_tokens + len(job.held) >= r.max_tokens
            or any(t in ends for t in toks)
        ):
            self._take(job, [], None, complete)

    def _take(self, job: Job, toks: list[int], lp=None, complete: bool = False):
        """Fold a request's new tokens in (with `lp`, host LogProbs [len(toks)] of them), after any
        it holds, emit their text as one delta, finish it when it is done."""
        r = job.req
        held, held_lp = job.held, job.held_lp
        job.held, job.held_lp = [], []
        followed = self._follow(job, toks[: r.max_tokens - job.n_tokens - len(held)])
        if followed is None:
            return
        toks, done = followed
        complete = complete or done
        if held:
            toks, lp = held + toks, _joined(held_lp + [lp])
        ends = set(r.stop_token_ids) | (set() if r.ignore_eos else self.eos)
        eos = next((i for i, t in enumerate(toks) if t in ends), None)
        text, taken = job.text.push_many(toks if eos is None else toks[:eos])
        stopped = job.text.stopped
        if lp is not None and r.logprobs is not None:  # the text's tokens, then the EOS that ended it
            job.logprobs += token_logprobs(lp, 0, toks[: taken + (eos is not None and not stopped)], r.logprobs)
        n = taken + (1 if eos is not None and not stopped else 0)  # an EOS counts as generated
        if n or not r.max_tokens:  # (max_tokens 0: an echo's prompt alone, read now)
            now = time.monotonic()
            self.observer.tokens(job, n, now)
            job.first_token_at = job.first_token_at or now
            job.last_token_at = now
        job.n_tokens += n
        self.generated += n
        if stopped or eos is not None or complete:
            return self._finish(job, "stop", [text])
        if job.n_tokens >= r.max_tokens:
            return self._finish(job, "length", [text])
        lps = self._settled_logprobs(job)
        if text or lps:
            job.emit(Delta(text, lps))

    def _settled_logprobs(self, job: Job, last: bool = False) -> list | None:
        """The log-probabilities of the tokens whose text has gone out (or goes out now); `last`:
        all that are left (the answer's end: an EOS or stop token id, with no text, is listed last)."""
        if job.req.logprobs is None:
            return None
        settled = len(job.logprobs) if last and not job.text.stopped else job.text.settled()
        out, job.logprobs_sent = job.logprobs[job.logprobs_sent : settled], max(job.logprobs_sent, settled)
        return out

    def _finish(self, job: Job, reason: str, text: list[str]):
        text.append(job.text.finish())  # held-back text is final now (empty after a stop string)
        if job.text.stopped:
            reason = "stop"
        first = job.parent or job
        if job.end(
            Finished(reason, job.n_tokens, first.cached or 0),
            "".join(text),
            self._settled_logprobs(job, last=True),
        ):
            first.answers_done += 1
            complete = first.answers_done == len(first.choices)
            self.finished += complete
            self.on_end(job, complete)


def _joined(pieces: list):
    """Host LogProbs [1, n_i] pieces (None: a call that read none) -> one [1, sum n_i], or None."""
    pieces = [x for x in pieces if x is not None]
    if not pieces:
        return None
    return jax.tree_util.tree_map(lambda *a: np.concatenate(a, axis=1), *pieces)


def _without_logprobs(kind: str, result):
    """A call's results with its log-probabilities dropped (no request of the call asked for them)."""
    if not isinstance(result, tuple):
        return result
    at = 2 if kind == "decode" else 1
    return tuple(None if i == at else x for i, x in enumerate(result))


def _row(lp, b: int, n: int | None):
    """Row b of host LogProbs as [1, n] (its first n tokens of [B, S]; n None: its one token of [B])."""
    if lp is None:
        return None
    return jax.tree_util.tree_map(lambda a: a[b][None, None] if n is None else a[b : b + 1, :n], lp)
