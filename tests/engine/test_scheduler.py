"""The scheduler on the engine core: every KV layout and tensor parallelism give the tokens
`Engine.generate` gives, with prefixes taken from the prefix cache, and a long prompt is prefilled
in chunks between the decode blocks of the running requests."""
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tiny

import jaxllm
from jaxllm.engine.jobs import Delta, Failed, Finished, Job
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.shapes import Shapes

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_layouts")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, os.path.join(HERE, "serve_layouts_run.py"), str(tmp)], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["full", "split-int8", "int8-rings", "split-int8-tp4", "e2b-split-int8",
                                  "spec-ngram-split-int8"])
def test_server_equals_engine_generate(layouts, case):
    """Greedy answers alone and to 64 concurrent clients equal `Engine.generate`'s of each request
    alone, also where prompts share prefixes with requests before them (of 16, 16 and 40 cached
    tokens, the last one past the sliding window, and the whole prompt but its last block) and in
    multi-turn conversations (from the second turn on, the earlier turns from the cache); a server
    that speculates equals the plain engine; n answers of one request (its blocks shared with its
    forks) are the request's alone, greedy and (without speculation) sampled with each answer's
    seed; /metrics counts the hits."""
    r = layouts[case]
    print(f"{case}: {r['layout']}, pools {r['cache_spec']} on {r['devices']} devices, {r['prefills']} prefills, "
          f"{r['fixed_blocks']} fixed blocks, cached {r['shared_cached']} {r['turns_cached']}, "
          f"speculation {r['speculation']}")
    assert r["alone"], case
    assert r["concurrent"], (case, r["mismatch"])
    assert r["shared"] and r["shared_concurrent"], case
    assert r["shared_cached"] == [0, 0, 16, 16, 40, 40], r["shared_cached"]
    assert r["turns"] and all(t[0] == 0 and min(t[1:]) > 0 for t in r["turns_cached"]), r["turns_cached"]
    assert r["forks"] and r["forks_shared"], case
    assert r["metric_hits"] >= 128, r["metric_hits"]
    assert ("int8" in r["layout"]) == ("int8" in case)
    if case.startswith("spec"):
        assert r["speculation"]["accepted"] > 0
    elif not case.endswith("tp4"):       # greedy requests decode in fixed blocks (a server that warms
        assert r["fixed_blocks"] > 0     # up compiles them in the background: not asserted there)
    if case.endswith("tp4"):             # KV heads over "model": the pools are sharded, not replicated
        assert r["devices"] == 4 and r["cache_spec"][3] == "model", r["cache_spec"]
    else:
        assert r["devices"] == 1


def test_shapes():
    s = Shapes(budget=2048, slots=64, max_piece=2048)
    assert s.lengths() == [128, 512, 2048] and s.decodes() == [1, 4, 16, 64]
    assert s.row_counts(128) == [1, 2, 4, 8, 16] and s.row_counts(512) == [1, 2, 4] and s.row_counts(2048) == [1]
    assert s.prefills() == [(1, 128), (2, 128), (4, 128), (8, 128), (16, 128), (1, 512), (2, 512), (4, 512),
                            (1, 2048)]
    assert s.choose([100]) == (1, 128, [100])
    assert s.choose([700]) == (1, 512, [512])                    # 512 + 188 costs less than 2048
    assert s.choose([5000, 10]) == (1, 2048, [2048])            # a long prompt fills the forward
    assert s.choose([300, 10]) == (2, 512, [300, 10])           # prompts share a forward of long pieces
    assert s.choose([10, 5000, 3]) == (2, 512, [10, 512])       # 3 tokens would cost a row of 512
    assert s.choose([60] * 40) == (16, 128, [60] * 16)
    assert s.decode_rows(1) == 1 and s.decode_rows(5) == 16 and s.decode_rows(64) == 64
    assert Shapes(budget=64, slots=9, max_piece=48).lengths() == [48]
    assert Shapes(budget=64, slots=9, max_piece=48).decodes() == [1, 4, 9]
    big = Shapes(budget=8192, slots=64, max_piece=4096)
    assert big.choose([100] * 64) == (64, 128, [100] * 64)
    assert big.choose([100] * 33) == (32, 128, [100] * 32)       # then 1, rather than 31 rows of padding
    assert big.choose([100] * 33, lambda P, C: P == big.row_counts(C)[-1]) == (64, 128, [100] * 33)
    assert big.choose([100_000, 100]) == (1, 4096, [4096])
    # while some shapes compile, a forward that holds a prompt whose tokens are scored takes a
    # compiled scoring shape, and one without takes a compiled plain shape
    from types import SimpleNamespace

    from jaxllm.engine.warmup import Warmup
    small = Shapes(budget=64, slots=4, max_piece=32)
    plain = SimpleNamespace(ready={("prefill", 1, 32), ("prefill", 2, 32)})
    both = SimpleNamespace(ready=plain.ready | {("score", 2, 32)})
    assert small.choose([7], Warmup.prefill_shapes(both, [False]))[:2] == (1, 32)
    assert small.choose([7], Warmup.prefill_shapes(both, [True]))[:2] == (2, 32)
    assert small.choose([7, 5], Warmup.prefill_shapes(both, [False, True]))[:2] == (2, 32)
    assert small.choose([7, 5], Warmup.prefill_shapes(plain, [False, True]))[:2] == (1, 32)


def test_the_backend_picks_the_prefill_budget(monkeypatch):
    """A server's prefill forwards take 8192 prompt tokens on a GPU whose allocator holds 40 GiB or
    more, 2048 elsewhere (this CPU, smaller GPUs, a runtime that does not say)."""
    from jaxllm.ops import xla

    class OnGpu(xla.XlaOps):
        platform = "gpu"
    assert xla.XlaOps().prefill_tokens == 2048
    for limit, want in ((60 << 30, 8192), (40 << 30, 8192), (30 << 30, 2048), (None, 2048)):
        monkeypatch.setattr(xla, "memory_limit", lambda device, v=limit: v)
        assert OnGpu().prefill_tokens == want, limit


# -- chunked prefill interleaved with decoding (in process, on a tiny model) ----------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    tiny.make("qwen3", d, seed=1)
    return jaxllm.load(str(d), quant="none", dtype="float32", max_ctx=256)


class Client:
    """A request as the HTTP handler sees it: events collected until it finishes (one of its
    answers, where it asks for `n`)."""

    def __init__(self, ids, max_tokens, **kw):
        self.events, self.done = [], threading.Event()
        self.job = Job.for_request(Request(ids, max_tokens, **kw), lambda i, ev: self.emit(ev))

    def emit(self, ev):
        self.events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            self.done.set()


def test_long_prompt_runs_one_chunk_between_tokens(engine):
    """A prompt of 10 chunks joins while 8 requests decode: it is prefilled a chunk at a time, the
    running requests keep decoding in between, and between any two tokens of a running request at
    most one prefill forward runs (from the scheduler's own record of what it ran)."""
    engine.tokenizer = type("Ids", (), {"decode": lambda self, ids: "".join(f" {i}" for i in ids)})()
    sched = Scheduler(engine, max_num_seqs=9, max_model_len=256, max_queue=16, decode_steps=4,
                      max_num_batched_tokens=16)
    sched.start(warmup=True)
    rng = np.random.default_rng(0)
    try:
        running = [Client(rng.integers(3, 150, 5).tolist(), 120, ignore_eos=True) for _ in range(8)]
        for c in running:
            sched.submit(c.job)
        t0 = time.time()
        while sched.load()["running"] < 8 or sched.results.generated < 8 * 8:
            assert time.time() - t0 < 300
            time.sleep(0.01)
        long = Client(rng.integers(3, 150, 160).tolist(), 8)
        sched.submit(long.job)
        for c in running + [long]:
            assert c.done.wait(600)
    finally:
        sched.shutdown()
    assert all(isinstance(c.events[-1], Finished) for c in running + [long])
    record = list(sched.record)
    pieces = [p for r in record if r["kind"] == "prefill" for p in r["pieces"] if p[0] == long.job.id]
    assert len(pieces) == 10 and sum(n for _, _, n in pieces) == 160           # 10 chunks of 16
    for c in running:
        since, gaps = None, []
        for r in record:
            if r["kind"] == "prefill":
                since = None if since is None else since + 1
            elif c.job.id in r.get("tokens", {}):
                if since is not None:
                    gaps.append(since)
                since = 0
        assert max(gaps) <= 1, gaps
    long_chunks = [i for i, r in enumerate(record) if r["kind"] == "prefill"
                   and any(p[0] == long.job.id for p in r["pieces"])]
    decoded_between = [any(r["kind"] == "decode" and r["tokens"] for r in record[a + 1:b])
                       for a, b in zip(long_chunks, long_chunks[1:])]
    assert all(decoded_between)             # the running requests kept decoding while it was prefilled
    text = "".join(e.text for e in long.events if isinstance(e, Delta))
    want = engine.generate_ids([long.job.req.prompt_ids], max_tokens=8)[0]
    assert text == want.text


def test_a_burst_with_one_prefix_computes_it_once(engine):
    """Eight requests that arrive together with one 100-token system prompt: the first prefills it,
    the others wait for its blocks and take 64 of its tokens from the prefix cache (a block),
    prefilling their own 10 tokens and the prefix's last 36; every answer is its own alone."""
    engine.tokenizer = type("Ids", (), {"decode": lambda self, ids: "".join(f" {i}" for i in ids)})()
    rng = np.random.default_rng(3)
    system = rng.integers(3, 150, 100).tolist()
    clients = [Client(system + rng.integers(3, 150, 10).tolist(), 6, temperature=0) for _ in range(8)]
    sched = Scheduler(engine, max_num_seqs=8, max_model_len=128, max_queue=8, max_num_batched_tokens=128)
    for c in clients:
        sched.submit(c.job)
    sched.start(warmup=False)
    try:
        for c in clients:
            assert c.done.wait(300)
    finally:
        sched.shutdown()
    sent = sum(n for r in sched.record if r["kind"] == "prefill" for _, _, n in r["pieces"])
    assert sent == 110 + 7 * 46, sent
    assert [c.job.cached for c in clients].count(64) == 7
    for c in clients:
        text = "".join(e.text for e in c.events if isinstance(e, Delta))
        assert text == engine.generate_ids([c.job.req.prompt_ids], max_tokens=6)[0].text


def test_a_burst_gathers_while_the_device_has_nothing_left_to_run(engine, monkeypatch):
    """Requests that arrive together share one prefill forward: the first prefill waits while they
    keep coming, and while answers whose last tokens are launched are still being read back (slots
    such answers hold do not stop it), as long as no running request has steps left to launch."""
    from jaxllm.engine import scheduler
    monkeypatch.setattr(scheduler, "ARRIVAL_GAP", 0.5)       # a loaded CI machine's gaps stay well under
    monkeypatch.setattr(scheduler, "ARRIVAL_WAIT", 10.0)
    sched = Scheduler(engine, max_num_seqs=4, max_model_len=32, max_queue=8)
    ending = Client([5, 6, 7], 4).job
    ending.slot, ending.started, ending.launched = 0, True, 4   # its last block launched, not read back yet
    sched.seats.slots[0] = ending

    def read_back():
        ending.done = True
        sched._ended(ending)
    timers = [threading.Timer(0.2, lambda: sched.submit(Client([8, 9], 4).job)), threading.Timer(1.0, read_back)]
    sched.submit(Client([5, 6], 4).job)
    t0 = time.monotonic()
    for t in timers:
        t.start()
    assert sched._gather_arrivals()
    assert time.monotonic() - t0 >= 1.0 and len(sched.seats.waiting) == 2 and list(sched.ended) == [ending]
    sched._free_ended()
    ending = Client([5, 6, 7], 4).job
    ending.slot, ending.started, ending.launched = 1, True, 3   # a step left to launch: no wait
    sched.seats.slots[1] = ending
    t0 = time.monotonic()
    assert not sched._gather_arrivals() and time.monotonic() - t0 < 0.2


def test_clients_whose_answers_ended_are_waited_for(engine, monkeypatch):
    """Clients that send their next request as each answer ends (a round of a benchmark, a batch
    job's workers): the first prefill waits for as many requests as answers completed, past pauses
    longer than ARRIVAL_GAP, while they keep coming RETURN_GAP apart; a client that does not come
    back holds the next burst RETURN_GAP once."""
    from jaxllm.engine import scheduler
    monkeypatch.setattr(scheduler, "ARRIVAL_GAP", 0.05)
    monkeypatch.setattr(scheduler, "RETURN_GAP", 0.6)
    monkeypatch.setattr(scheduler, "RETURN_WAIT", 10.0)
    sched = Scheduler(engine, max_num_seqs=4, max_model_len=32, max_queue=8)
    for _ in range(2):                     # two requests complete, a third's answer ends with it failing
        sched._ended(Client([5, 6], 4).job, True)
    sched._ended(Client([5, 6], 4).job)
    assert sched.returning == 2
    sched.submit(Client([5, 6], 4).job)
    later = threading.Timer(0.3, lambda: sched.submit(Client([8, 9], 4).job))
    t0 = time.monotonic()
    later.start()
    assert sched._gather_arrivals()
    took = time.monotonic() - t0
    assert 0.3 <= took < 0.6 and len(sched.seats.waiting) == 2 and sched.returning == 0

    sched.seats.waiting.clear()
    for _ in range(2):                     # two complete, one comes back
        sched._ended(Client([5, 6], 4).job, True)
    sched.submit(Client([5, 6], 4).job)
    t0 = time.monotonic()
    assert sched._gather_arrivals()
    took = time.monotonic() - t0
    assert 0.5 <= took < 3.0 and len(sched.seats.waiting) == 1 and sched.returning == 0
    sched.submit(Client([7, 8], 4).job)    # the next burst: no one owed, ARRIVAL_GAP alone
    t0 = time.monotonic()
    assert sched._gather_arrivals() and time.monotonic() - t0 < 0.4


def test_no_request_waits_for_a_compile(engine, monkeypatch):
    """The scheduler serves once each kind's largest shape is compiled (and one prefill that
    scores its prompts' tokens): a request meanwhile runs on those (padding rows) with
    `Engine.generate`'s tokens, one whose prompt is scored (`echo`) too; the smaller shapes compile
    on a thread of their own and are taken up once compiled; the engine thread itself never
    compiles, nor does any program compile for requests of every kind once the warm-up is done
    (the engine's own record): log-probabilities, a prompt's own scores, n answers, penalties and
    rules."""
    engine.tokenizer = type("Ids", (), {"decode": lambda self, ids: "".join(f" {i}" for i in ids)})()
    gate, orig = threading.Event(), engine.precompile

    def held(calls, threads=None, counted=True, on_compiled=None):      # the background compiles wait
        if not counted:
            assert gate.wait(300)
        return orig(calls, threads, counted, on_compiled)
    monkeypatch.setattr(engine, "precompile", held)
    sched = Scheduler(engine, max_num_seqs=4, max_model_len=32, max_queue=8, decode_steps=4,
                      max_num_batched_tokens=64,     # prefills of 1 and 2 pieces of 32, decodes over 1 and 4 slots
                      first_runs=True)               # as on a GPU
    parts = []
    sched.observer.busy = lambda thread, part, s: parts.append((thread, part))
    prompt = np.random.default_rng(4).integers(3, 150, 7).tolist()

    def answer():
        c = Client(prompt, 6)
        sched.submit(c.job)
        assert c.done.wait(300) and isinstance(c.events[-1], Finished)
        rows = {(r["rows"], r["fixed"]) for r in sched.record if r["kind"] == "decode" and c.job.id in r["tokens"]}
        return "".join(e.text for e in c.events if isinstance(e, Delta)), rows
    primed, prime = [], sched.warmup.prime
    sched.warmup.prime = lambda keys: primed.extend(keys) or prime(keys)
    sched.start(warmup=True)
    try:
        assert sched.load()["compiling"] == 5        # the fixed blocks over 1 and 4 slots, the scoring prefill of 1
        assert set(primed) == sched.warmup.ready            # what serves first has run once
        assert sched.warmup.ready == {("prefill", 2, 32), ("score", 2, 32), ("decode", 4), ("fork",)}
        assert (sched.shapes.choose([7], sched.warmup.prefill_shapes([False]))[:2], sched.warmup.decode_rows(1)) == ((2, 32), 4)
        early, early_rows = answer()
        echo = Client(prompt, 3, echo=True, logprobs=1)
        sched.submit(echo.job)
        assert echo.done.wait(300) and isinstance(echo.events[-1], Finished)
        gate.set()
        t0 = time.time()
        while sched.load()["compiling"]:
            assert time.time() - t0 < 300
            time.sleep(0.05)
        assert sched.warmup.ready is None and sched.warmup.prefill_shapes([True]) is None and sched.warmup.decode_rows(1) == 1
        while set(primed) != set(sched.warmup.groups):      # the others run once as the engine thread idles
            assert time.time() - t0 < 300
            time.sleep(0.05)
        assert len(primed) == len(sched.warmup.groups)
        late, late_rows = answer()
        made, rng = engine.compiles.programs, np.random.default_rng(5)
        varied = [Client(rng.integers(3, 150, 12).tolist(), 6, logprobs=2),
                  Client(rng.integers(3, 150, 9).tolist(), 4, echo=True, logprobs=1),
                  Client(prompt, 5, n=2, temperature=0.9, seed=5),
                  Client(rng.integers(3, 150, 20).tolist(), 8, repetition_penalty=1.2, logit_bias={7: 2.0},
                         stop_token_ids=[9], min_tokens=1)]
        for c in varied:
            sched.submit(c.job)
        for c in varied:
            assert c.done.wait(300)
        while sched.load()["running"]:                 # the other answer of the request for two
            assert time.time() - t0 < 300
            time.sleep(0.05)
        assert engine.compiles.programs == made
    finally:
        sched.shutdown()
    want = engine.generate_ids([prompt], max_tokens=6)[0].text
    assert early == late == want and early_rows == {(4, False)} and late_rows == {(1, True)}
    assert ("engine", "compile") not in parts


def test_a_warm_start_runs_the_largest_shapes_before_serving(engine):
    """With every call compiled already (a restart that reads them back), the largest shape of each
    kind runs once before serving and the others as the engine thread idles, once each. With
    `freeze_heap` the heap leaves the garbage collector's passes before serving and again once
    every shape has run."""
    import gc
    kw = dict(max_num_seqs=4, max_model_len=32, max_queue=8, decode_steps=4, max_num_batched_tokens=64,
              first_runs=True, freeze_heap=True)
    sched = Scheduler(engine, **kw)
    engine.precompile([c for calls in sched.warmup.calls().values() for c in calls])
    primed, prime = [], sched.warmup.prime
    sched.warmup.prime = lambda keys: primed.extend(keys) or prime(keys)
    settled, settle = [], sched.warmup.settle_heap
    sched.warmup.settle_heap = lambda what: settled.append((what, len(primed), gc.get_freeze_count())) or settle(what)
    sched.start(warmup=True)
    try:
        assert settled == [("warm", 4, 0)] and gc.get_freeze_count() > 0
        load = sched.load()
        assert sched.warmup.ready is None and load["compiling"] == 0 and load["warming"] <= len(sched.warmup.groups) - 4
        assert set(primed[:4]) == {("decode", 4), ("prefill", 2, 32), ("score", 2, 32), ("fork",)}
        t0 = time.time()
        while len(primed) < len(sched.warmup.groups):
            assert time.time() - t0 < 300
            time.sleep(0.05)
        assert sorted(primed) == sorted(sched.warmup.groups) and sched.load()["warming"] == 0
        t0 = time.time()
        while len(settled) < 2:
            assert time.time() - t0 < 60
            time.sleep(0.05)
        assert settled[1][:2] == ("every shape run once", len(sched.warmup.groups)) and settled[1][2] > 0
    finally:
        sched.shutdown()
        gc.unfreeze()

def test_warmup_runs_each_call_once_and_changes_nothing(engine, monkeypatch):
    """Warming up runs every call it compiled once where first runs cost more (a GPU loads a call's
    kernels at its first run), on the slot table with nothing to do: after a request has ended in a slot, running every call
    again leaves the cache and the slot table bit for bit as they were."""
    from collections import Counter

    import jax

    from jaxllm.engine.engine import _signature
    from jaxllm.engine.slots import Pieces
    sched = Scheduler(engine, max_num_seqs=4, max_model_len=32, max_queue=8, decode_steps=4,
                      max_num_batched_tokens=64, first_runs=True)
    assert not Scheduler(engine, 4, 32, 8).warmup.first_runs       # a CPU's first runs cost no more
    ran, run = [], engine.run
    monkeypatch.setattr(engine, "run", lambda name, *args, **static: ran.append(_signature(name, args, static))
                        or run(name, *args, **static))
    sched.warmup.compile(background=False)
    calls = [c for cs in sched.warmup.groups.values() for c in cs]
    assert len(calls) == 13 and Counter(ran) == Counter(_signature(*c) for c in calls)
    core = sched.core
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :5] = [5, 9, 23, 7, 11]
    core.prefill(Pieces.make(tokens, length=[5], final=[True], rows=[2], max_new=[3]))
    toks, count, _ = core.decode(8, sched.out_size, np.zeros(4, bool), 4)
    assert np.asarray(count)[2] == 2                  # its 2 tokens after the first: the slot has ended
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(core.state)]
    sched.warmup.prime(list(sched.warmup.groups))
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(core.state)]
    assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))


def test_a_request_no_pool_can_hold_is_refused_not_kept_waiting(engine):
    """n = 3 answers on 4 slots of 64 positions: the prompt's blocks and the forks' first blocks
    are more than a pool sized for every slot holds, so the request can never start; it ends with
    a 400 saying so (it used to wait forever), and the next request runs."""
    engine.tokenizer = type("Ids", (), {"decode": lambda self, ids: "".join(f" {i}" for i in ids)})()
    big = Client(list(range(3, 63)), 2, n=3, temperature=0)
    small = Client([5, 6, 7], 2, temperature=0)
    sched = Scheduler(engine, max_num_seqs=4, max_model_len=64, max_queue=8)
    sched.submit(big.job)
    sched.submit(small.job)
    sched.start(warmup=False)
    try:
        assert big.done.wait(60) and small.done.wait(120)
    finally:
        sched.shutdown()
    failed = [e for e in big.events if isinstance(e, Failed)]
    assert failed and failed[0].status == 400 and "whole pool" in failed[0].message, big.events
    assert isinstance(small.events[-1], Finished)
