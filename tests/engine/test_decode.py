"""Prefill, step-by-step decode and the fused on-device loop must agree with each other."""
import jax
import numpy as np
import pytest
import tiny

import jaxllm
from jaxllm import RuntimeConfig
from jaxllm.engine.slots import Pieces


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def eng(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    tiny.make(request.param, d, seed=3)
    return jaxllm.load(str(d), quant="none", dtype="float32", max_ctx=64, kv_options=jaxllm.KVOptions(block_size=8))


def test_step_decode_equals_full_forward(eng):
    """Feeding tokens one at a time through the cache reproduces the full causal forward, past
    several wraps of the sliding layers' blocks (a window of 8 in blocks of 8: two a row)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, eng.cfg.vocab_size, (2, 30)).astype(np.int32)
    full = eng.logits(ids)
    stepper = eng.core(2, 32, span=1)
    if "sliding" in stepper.plan.widths:
        assert stepper.plan.widths["sliding"] == 2
    for t in range(ids.shape[1]):
        logits = stepper.step_logits(ids[:, t], np.full(2, t))
        assert tiny.rel_err(np.asarray(logits), full[:, t]) < 1e-4, t


def test_prefill_then_step_equals_full_forward(eng):
    """Right-padded prompts of different lengths in one prefill forward, then one token a step."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, eng.cfg.vocab_size, (2, 24)).astype(np.int32)
    lengths = np.array([13, 9], np.int32)
    full = [eng.logits(ids[b:b + 1, :24]) for b in range(2)]
    tokens = np.where(np.arange(16)[None] < lengths[:, None], ids[:, :16], 0)
    stepper = eng.core(2, 32)
    logits = eng.layout.get(stepper.prefill(Pieces.make(tokens, 0, lengths), out="logits"))
    for b in range(2):
        assert tiny.rel_err(logits[b, lengths[b] - 1], full[b][0, lengths[b] - 1]) < 1e-4
    pos = lengths.copy()
    for _ in range(6):         # continue each row with its own reference tokens
        nxt = ids[np.arange(2), pos]
        logits = stepper.step_logits(nxt, pos)
        for b in range(2):
            assert tiny.rel_err(np.asarray(logits[b]), full[b][0, pos[b]]) < 1e-4
        pos = pos + 1


def test_fused_loop_equals_python_stepping(eng):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, eng.cfg.vocab_size, n).tolist() for n in (5, 12, 9)]
    n_new = 20
    fused = eng.generate_ids(prompts, max_tokens=n_new)
    for p, c in zip(prompts, fused):
        seq = list(p)
        logits = eng.logits(np.array([seq], np.int32))[0, -1]
        stepped = []
        stepper = eng.core(1, 64)
        for t, tok in enumerate(seq[:-1]):
            stepper.step_logits([tok], [t])
        pos = len(seq) - 1
        tok = seq[-1]
        for _ in range(n_new):
            logits = stepper.step_logits([tok], [pos])
            tok = int(np.argmax(np.asarray(logits)[0]))
            pos += 1
            if tok in eng.cfg.eos_ids:
                break
            stepped.append(tok)
        assert c.token_ids == stepped


def test_fixed_blocks_equal_the_loop(eng):
    """Greedy blocks of a fixed number of steps (which a GPU runs without the host) give the tokens
    and counts of the loop's blocks, a row that reaches its limit inside a block included."""
    from jaxllm.engine.sampling import SamplingParams
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, eng.cfg.vocab_size, n).tolist() for n in (5, 12, 9)]
    cores = [eng.core(4, 64), eng.core(4, 64)]
    for core in cores:
        core.prefill_prompts(prompts + [[1]], SamplingParams.make(4), max_new=np.array([7, 18, 13, 0]))
    for _ in range(5):
        loop = jax.tree_util.tree_map(eng.layout.get, cores[0].decode(4, 4, rows=4)[:2])
        fixed = jax.tree_util.tree_map(eng.layout.get, cores[1].decode(None, 4, rows=4)[:2])
        np.testing.assert_array_equal(fixed[1], loop[1])
        np.testing.assert_array_equal(fixed[0], loop[0])
    assert int(cores[1].state.slots.active.sum()) == 0


def test_sampling_is_reproducible_and_seed_dependent(eng):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    kw = dict(max_tokens=16, temperature=1.0, top_k=40, top_p=0.9)
    a = eng.generate_ids(prompts, seed=7, **kw)
    b = eng.generate_ids(prompts, seed=7, **kw)
    c = eng.generate_ids(prompts, seed=8, **kw)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # row b samples with seed + b: row 1 of the scheduler's call (prompts of mixed lengths) is its
    # prompt alone with seed 8, and row 1 of a lockstep call (one length) with seed 7, whose row 0
    # draws apart from it
    alone = eng.generate_ids(prompts[1:], seed=8, **kw)
    assert alone[0].token_ids == a[1].token_ids
    lockstep = eng.generate_ids([prompts[1]] * 2, seed=7, **kw)
    assert lockstep[1].token_ids == a[1].token_ids != lockstep[0].token_ids


@pytest.mark.parametrize("eng", ["gemma3"], indirect=True)     # its rings and global layers cover Qwen3's
def test_forked_slots_decode_as_their_own_requests(eng):
    """`fork` right after a prompt ends (prefilled in two pieces, past the sliding window), in a
    pool whose blocks the host hands out: each copy shares the prompt's full blocks, gets its own
    copy of the partial last one, draws its own first token with its own seed and decodes what the
    request alone decodes with that seed (penalties and token rules copied with the slot, counts
    restarted), and the source decodes on as before."""
    from jaxllm.engine.sampling import Penalties, SamplingParams, TokenRules
    from jaxllm.engine.slots import Forks
    prompt = list(range(5, 25))
    kw = dict(temperature=0.9, top_k=40, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={9: 3.0},
              stop_token_ids=[11], min_tokens=2)
    params = SamplingParams.make(1, 0.9, 40, None, 7)
    pen, rules = Penalties.make(1, 0.5, 0.0, 1.2), TokenRules.make(1, [{9: 3.0}], [[11]], 2)
    core = eng.core(4, 64, budget=eng.pool_plan(4, 64, span=44).total, span=44)     # 44: the decode call's
    blocks = core.blocks
    blocks.admit(1)
    assert blocks.allocate(1, 0, 20)
    for s in (0, 12):
        piece = np.zeros((1, 12), np.int32)
        piece[0, :len(prompt[s:s + 12])] = prompt[s:s + 12]
        first = core.prefill(Pieces.make(piece, s, min(12, 20 - s), s > 0, [1], params, 10, penalties=pen,
                                         rules=rules))
    copies = [blocks.fork(1, dst, 20) for dst in (0, 3)]
    assert all(len(c["global"]) == 1 for c in copies)         # 20 positions: the last of 3 blocks of 8
    for row in (0, 1, 3):
        assert blocks.allocate(row, 20, 64)
    forked = core.fork(Forks.make(4, [1, 1], [0, 3], [8, 9]), {n: copies[0][n] + copies[1][n] for n in copies[0]})
    toks, count, _ = (np.asarray(x) for x in core.decode(20, 16))
    got = {7: [int(np.asarray(first)[0])] + toks[1, :count[1]].tolist(),
           8: [int(np.asarray(forked)[0])] + toks[0, :count[0]].tolist(),
           9: [int(np.asarray(forked)[1])] + toks[3, :count[3]].tolist()}
    assert count[2] == 0 and len({tuple(v) for v in got.values()}) == 3
    for seed, tokens in got.items():          # (`generate_ids` leaves an ending stop token out)
        want = eng.generate_ids([prompt], max_tokens=10, seed=seed, **kw)[0]
        assert tokens[:len(want.token_ids)] == want.token_ids and len(tokens) - len(want.token_ids) <= 1, seed


def test_top_k_one_is_greedy(eng):
    prompts = [[3, 4, 5, 6, 7]]
    greedy = eng.generate_ids(prompts, max_tokens=12)
    topk1 = eng.generate_ids(prompts, max_tokens=12, temperature=0.8, top_k=1, seed=3)
    assert greedy[0].token_ids == topk1[0].token_ids


def test_max_tokens_per_row_and_finish_reason(eng):
    out = eng.generate_ids([[1, 2, 3]], max_tokens=5)
    assert len(out[0].token_ids) <= 5
    assert out[0].finish_reason in ("length", "stop")
    if out[0].finish_reason == "length":
        assert len(out[0].token_ids) == 5


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_are_the_log_softmax_of_the_logits(eng, speculative):
    """Each token's log-probability and top alternatives, computed in the loop (and in speculative
    cycles), equal log_softmax of `Engine.logits` at its position, greedy and sampled."""
    from jaxllm.engine.engine import Engine
    from jaxllm.engine.speculative import Speculation
    gen = eng if not speculative else Engine(eng.cfg, eng.weights, None, dtype="float32", max_ctx=64,
                                             speculation=Speculation("ngram", 3))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11]]
    for temperature in (0.0, 0.9):
        outs = gen.generate_ids(prompts, max_tokens=12, temperature=temperature, seed=3, logprobs=3)
        for p, c in zip(prompts, outs):
            seq = p + c.token_ids
            logits = np.asarray(eng.logits(np.array([seq], np.int32))[0], np.float64)
            want = logits - logits.max(-1, keepdims=True)
            want -= np.log(np.exp(want).sum(-1, keepdims=True))
            assert len(c.logprobs) == len(c.token_ids) > 0
            for i, t in enumerate(c.logprobs):
                at = len(p) - 1 + i
                assert t.token_id == seq[at + 1]
                np.testing.assert_allclose(t.logprob, want[at, t.token_id], atol=1e-4)
                assert [j for j, _ in t.top] == np.argsort(-want[at], kind="stable")[:3].tolist()
                np.testing.assert_allclose([v for _, v in t.top], np.sort(want[at])[::-1][:3], atol=1e-4)
    assert eng.generate_ids(prompts[:1], max_tokens=2)[0].logprobs is None
    with pytest.raises(jaxllm.RequestError, match="'logprobs' must be an integer from 0 to 20"):
        eng.generate_ids(prompts, max_tokens=2, logprobs=21)


def penalized(logits, prompt, made, presence, frequency, repetition):
    """numpy: logits [V] after vLLM's penalties, given the prompt and the tokens generated so far."""
    counts = np.bincount(np.asarray(made, np.int64), minlength=logits.shape[0]).astype(np.float64)
    seen = counts > 0
    seen_any = seen.copy()
    seen_any[np.asarray(prompt)] = True
    x = np.where(seen_any, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    return x - frequency * counts - presence * seen


PENALTIES = [{"presence_penalty": 1.5}, {"frequency_penalty": 0.7}, {"repetition_penalty": 1.8},
             {"repetition_penalty": 0.6}, {"presence_penalty": -0.5, "frequency_penalty": 0.4, "repetition_penalty": 1.3}]


@pytest.mark.parametrize("speculative", [False, True])
def test_penalties_match_a_numpy_reference(eng, speculative):
    """Greedy tokens under presence, frequency and repetition penalties (alone and together, in the
    loop and in speculative cycles) are the argmax of `Engine.logits` penalized in numpy at each
    position; log-probabilities stay those of the raw logits."""
    from jaxllm.engine.engine import Engine
    from jaxllm.engine.speculative import Speculation
    gen = eng if not speculative else Engine(eng.cfg, eng.weights, None, dtype="float32", max_ctx=64,
                                             speculation=Speculation("ngram", 3))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10]]
    plain = [c.token_ids for c in gen.generate_ids(prompts, max_tokens=16)]
    changed, verified = 0, 0
    for kw in PENALTIES:
        outs = gen.generate_ids(prompts, max_tokens=16, logprobs=0, **kw)
        verified += gen.stats.spec["cycles"] if speculative else 0
        args = [kw.get(k, d) for k, d in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                          ("repetition_penalty", 1.0))]
        for p, c, before in zip(prompts, outs, plain):
            seq = p + c.token_ids
            logits = np.asarray(eng.logits(np.array([seq], np.int32))[0], np.float64)
            for i, t in enumerate(c.token_ids):
                at = len(p) - 1 + i
                want = penalized(logits[at], p, c.token_ids[:i], *args)
                assert t == int(np.argmax(want)), (kw, i)
                raw = logits[at] - logits[at].max()
                np.testing.assert_allclose(c.logprobs[i].logprob, raw[t] - np.log(np.exp(raw).sum()), atol=1e-4)
            changed += c.token_ids != before
    assert changed >= len(PENALTIES)          # the penalties changed what was generated
    assert verified > 0 or not speculative    # and drafts were verified under them
    with pytest.raises(jaxllm.RequestError, match="'repetition_penalty' must be > 0"):
        eng.generate_ids(prompts, max_tokens=2, repetition_penalty=0)


def forward_and_steps(eng, ids):
    """Full-forward logits of ids [2, T] and the logits of decoding them one step at a time."""
    stepper, steps = eng.core(2, 16), []
    for t in range(ids.shape[1]):
        lg = stepper.step_logits(ids[:, t], np.full(2, t))
        steps.append(np.asarray(lg))
    return eng.logits(ids), np.stack(steps)


@pytest.mark.parametrize("family,layers", [("gemma3", 8), ("gemma4", 8)])
def test_period_scan_equals_conditional_scan(family, layers, tmp_path):
    """The layer scan over whole periods of the sliding/global pattern (what GPUs run: no
    conditional per layer) against the scan with a `lax.cond` per layer: full forward and decode
    steps. Gemma 3's 8 layers are one period of 6 and two more; Gemma 4's are one period of 8."""
    from jaxllm.model.schedule import counted_layers, layer_period
    if family == "gemma3":
        tiny.make(family, tmp_path, seed=4, num_hidden_layers=layers)
    else:
        import gemma4_refs
        gemma4_refs.build("31b").save_pretrained(tmp_path)
    ids = np.random.default_rng(3).integers(0, 160, (2, 12)).astype(np.int32)
    got = {}
    for mode in ("cond", "period"):
        eng = jaxllm.load(str(tmp_path), quant="none", dtype="float32", max_ctx=32,
                          runtime=RuntimeConfig(layer_scan=mode))
        assert eng.ops.layer_scan() == mode
        got[mode] = forward_and_steps(eng, ids)
    assert layer_period(eng.cfg) == {"gemma3": 6, "gemma4": 8}[family] and not counted_layers(eng.cfg)
    assert tiny.rel_err(got["period"][0], got["cond"][0]) < 1e-5
    assert tiny.rel_err(got["period"][1], got["cond"][1]) < 1e-5


def test_carried_layer_index_equals_the_schedule_scan(tmp_path, monkeypatch):
    """Qwen3 (one branch, layer i on stack and cache entry i) scans with the layer index in the
    carry; against the scan over the schedule's index arrays: full forward and decode steps."""
    from jaxllm.model import forward as model
    from jaxllm.model import schedule
    tiny.make("qwen3", tmp_path, seed=5)
    ids = np.random.default_rng(4).integers(0, 160, (2, 10)).astype(np.int32)
    got = {}
    for counted in (True, False):
        # where it is defined, and the name the layer scan calls it by
        monkeypatch.setattr(schedule, "counted_layers", lambda cfg, c=counted: c)
        monkeypatch.setattr(model, "counted_layers", lambda cfg, c=counted: c)
        eng = jaxllm.load(str(tmp_path), quant="none", dtype="float32", max_ctx=32)
        got[counted] = forward_and_steps(eng, ids)
    monkeypatch.undo()
    assert schedule.counted_layers(eng.cfg)
    assert tiny.rel_err(got[True][0], got[False][0]) < 1e-6
    assert tiny.rel_err(got[True][1], got[False][1]) < 1e-6


@pytest.mark.parametrize("family,scan", [("qwen3", "auto"), ("gemma3", "period"), ("gemma3", "cond")])
def test_unrolled_layer_scan_equals_rolled(family, scan, tmp_path):
    """The layer scan unrolled whole (what GPUs run) and two layers an iteration, against one layer
    an iteration: full forward and decode steps. Qwen3 carries the layer index; Gemma 3's 14 layers
    are two periods of 6 and two more, or a conditional per layer."""
    tiny.make(family, tmp_path, seed=6, num_hidden_layers=8 if family == "qwen3" else 14)
    ids = np.random.default_rng(5).integers(0, 160, (2, 11)).astype(np.int32)
    got = {}
    for unroll in (1, 2, "full"):
        eng = jaxllm.load(str(tmp_path), quant="none", dtype="float32", max_ctx=32,
                          runtime=RuntimeConfig(layer_scan=scan, scan_unroll=unroll))
        assert eng.runtime.scan_unroll == unroll and eng.runtime.layer_scan == scan
        got[unroll] = forward_and_steps(eng, ids)
    for unroll in (2, "full"):
        assert tiny.rel_err(got[unroll][0], got[1][0]) < 1e-6
        assert tiny.rel_err(got[unroll][1], got[1][1]) < 1e-6


def test_scan_unroll_is_checked(monkeypatch):
    from functools import partial

    from jaxllm import ops
    from jaxllm.errors import ModelError
    n = 8                                                   # the model's layer count

    def scan_unroll(rows, tokens_per_row, **runtime):
        return ops.select(RuntimeConfig(**runtime)).scan_unroll(n, rows, tokens_per_row)
    # the kernels on GPUs alone
    assert scan_unroll(1, 1, kernels="auto") == (8 if jax.default_backend() == "gpu" else 1)
    assert scan_unroll(1, 1, kernels="xla") == 1                      # the XLA path: rolled
    pallas = partial(scan_unroll, kernels="pallas")
    assert pallas(1, 1) == pallas(256, 1) == 8                        # a decode step on the kernels
    assert pallas(1, 2048) == pallas(257, 1) == 1                     # a prefill; rows for XLA
    for value, want in (("full", 8), (3, 3), (40, 8)):
        for kernels in ("pallas", "xla"):
            assert scan_unroll(1, 1, kernels=kernels, scan_unroll=value) == want
            assert scan_unroll(4, 100, kernels=kernels, scan_unroll=value) == want
    for value in (0, -2, "two", 1.5):
        with pytest.raises(ModelError, match="scan_unroll must be a positive number of layers or 'full'"):
            RuntimeConfig(scan_unroll=value)
    # JAXLLM_SCAN_UNROLL, as `RuntimeConfig.from_env` reads it
    monkeypatch.delenv("JAXLLM_SCAN_UNROLL", raising=False)
    assert RuntimeConfig.from_env().scan_unroll is None
    for raw, want in (("full", 8), (" 3 ", 3), ("40", 8)):
        monkeypatch.setenv("JAXLLM_SCAN_UNROLL", raw)
        rt = RuntimeConfig.from_env(kernels="pallas")
        assert ops.select(rt).scan_unroll(n, 1, 1) == ops.select(rt).scan_unroll(n, 4, 100) == want
    for raw in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("JAXLLM_SCAN_UNROLL", raw)
        with pytest.raises(ModelError,
                           match="JAXLLM_SCAN_UNROLL: scan_unroll must be a positive number of layers or 'full'"):
            RuntimeConfig.from_env()


def test_layer_scan_mode_is_checked(monkeypatch):
    from jaxllm import ops
    from jaxllm.errors import ModelError
    with pytest.raises(ModelError, match="layer_scan must be one of"):
        RuntimeConfig(layer_scan="unrolled")
    monkeypatch.setenv("JAXLLM_LAYER_SCAN", "unrolled")
    with pytest.raises(ModelError, match="JAXLLM_LAYER_SCAN: layer_scan must be one of"):
        RuntimeConfig.from_env()
    monkeypatch.setenv("JAXLLM_LAYER_SCAN", "auto")
    assert RuntimeConfig.from_env().layer_scan == "auto"
    from jaxllm.ops.xla import CPU_COND_POSITIONS
    for kernels in ("auto", "xla", "pallas"):
        rt = RuntimeConfig(kernels=kernels, layer_scan="auto")
        small = "cond" if jax.default_backend() == "cpu" else "period"
        assert ops.select(rt).layer_scan(CPU_COND_POSITIONS - 1) == small
        assert ops.select(rt).layer_scan(CPU_COND_POSITIONS) == "period"
        for mode in ("cond", "period"):
            assert ops.select(RuntimeConfig(kernels=kernels, layer_scan=mode)).layer_scan() == mode
