"""Long contexts: int8 global layers and sliding layers over a window's blocks, against the compute-dtype KV, with
the threshold lowered so tiny models take the long-context path on the CPU."""
import os
import subprocess
import sys
import warnings
from functools import lru_cache, partial

import jax.numpy as jnp
import numpy as np
import pytest
from kv_tiny_models import gemma4_31b, gemma4_e2b, random_weights, tiny_gemma3, tiny_gemma4_like

import jaxllm
from jaxllm.config.kv import KVOptions
from jaxllm.engine.engine import Engine
from jaxllm.engine.host import pad_rows
from jaxllm.engine.perplexity import perplexity_ids
from jaxllm.engine.slots import Pieces
from jaxllm.errors import ModelError, RequestError
from jaxllm.kv.options import KVLayout
from jaxllm.kv.paged import kind_specs
from jaxllm.kv.plan import PoolPlan, check_fits

WINDOW = 16
# Lowered so that max_ctx 256 is "long"; blocks of 8, reads of 16 and chunks of 24 (> the window)
# make every prompt below cross block and chunk boundaries and reuse the sliding tables' columns.
SPLIT = KVOptions(threshold=64, block_size=8, read_block=16, prefill_chunk=24)
FULL = KVOptions(threshold=1024, block_size=8, read_block=16, prefill_chunk=1024)
# int8 K/V (a scale per token and head) moves the tiny random models' float32 logits by a few
# tenths of a percent of their largest magnitude (measured 0.15-0.2% on Gemma 3 and the 31B-like
# model), up to 3.3% on the E2B-like one, whose random attention is the most sensitive (its error
# equals that of the full cache fed int8-rounded K/V); allowed: 5%.
INT8_LOGIT_TOL = 5e-2


def logit_err(got, ref) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())

# Gemma 3; Gemma 4 with k_eq_v global layers (31B-like); Gemma 4 with per-layer inputs and layers
# that read another layer's cache (E2B-like).
MODELS = [tiny_gemma3, gemma4_31b, gemma4_e2b]


@lru_cache(maxsize=None)          # shared by the tests below, so each engine compiles once
def engines(make_cfg):
    cfg = make_cfg(WINDOW)
    w = random_weights(cfg)
    mk = partial(Engine, cfg, w, None, dtype="float32", max_ctx=256)
    return cfg, mk(kv_quant="auto", kv_options=FULL), mk(kv_quant="auto", kv_options=SPLIT), \
        mk(kv_quant="none", kv_options=SPLIT)


def test_long_prompt_prefilled_in_chunks_on_the_full_cache():
    cfg, full, _, _ = engines(tiny_gemma3)
    chunks = Engine(cfg, full.weights, None, dtype="float32", max_ctx=256,
                    kv_options=KVOptions(threshold=1024, prefill_chunk=24))
    assert not chunks.kv_layout.int8
    ps = prompts(cfg)
    assert [c.token_ids for c in chunks.generate_ids(ps, max_tokens=6)] == \
        [c.token_ids for c in full.generate_ids(ps, max_tokens=6)]


def prompts(cfg, seed=1):
    r = np.random.default_rng(seed)
    return [r.integers(3, cfg.vocab_size, n).tolist() for n in (50, 33)]


@pytest.mark.parametrize("make_cfg", MODELS)
def test_split_int8_generates_like_full_cache(make_cfg):
    cfg, full, int8, _ = engines(make_cfg)
    assert not full.kv_layout.int8 and int8.kv_layout == KVLayout(int8=True)
    ps = prompts(cfg)
    ref = full.generate_ids(ps, max_tokens=40)
    got = int8.generate_ids(ps, max_tokens=40)
    assert len(ps[0]) + 40 > 3 * WINDOW and len(ps[0]) > int8.kv_options.prefill_chunk
    for r, g in zip(ref, got):             # the logits themselves: test_decode_steps_through_ring_wraps
        assert len(r.token_ids) == 40
        assert g.token_ids == r.token_ids


@pytest.mark.parametrize("make_cfg", MODELS)
def test_decode_steps_through_ring_wraps(make_cfg):
    """Token-by-token decode (T = 1 per step), the sliding layers' blocks reused every 24 positions,
    gives the full forward's logits, in the compute dtype and with int8 global layers."""
    cfg, full, int8, plain = engines(make_cfg)
    seq = np.array(prompts(cfg, seed=4)[0] + prompts(cfg, seed=5)[1], np.int32)[None]   # 83 > 5 windows
    ref = full.logits(seq)[0]
    # float32 sums in another order (83 steps against one forward): the E2B-like model's differ by
    # 0.8e-5 of the largest logit as XLA compiles by default, 1.3e-5 without LLVM's optimizations
    for eng, tol in ((plain, 2e-5), (int8, INT8_LOGIT_TOL)):
        stepper = eng.core(1, 96, span=1)
        rows = []
        for t in range(seq.shape[1]):
            logits = stepper.step_logits(seq[:, t], np.array([t]))
            rows.append(np.asarray(logits)[0])
        width = stepper.plan.widths["sliding"]
        assert width * SPLIT.block_size == 24 < seq.shape[1]          # the window and a block
        err = logit_err(np.stack(rows), ref)
        print(f"{make_cfg.__name__} step by step, {eng.kv_layout.name}: max err / max |logit| {err:.2e}")
        assert err < tol


@pytest.mark.parametrize("make_cfg", [tiny_gemma3, gemma4_e2b])
def test_int8_rings(make_cfg):
    """KVOptions.int8_rings: the sliding layers' blocks in int8 too (Gemma 3; the E2B-like model,
    whose shared-KV layers read another layer's blocks). Prompts prefilled in chunks, then
    token-by-token decode past several reuses of the sliding tables' columns, against the float32
    compute-dtype KV."""
    from dataclasses import replace
    cfg, full, _, _ = engines(make_cfg)
    eng = Engine(cfg, full.weights, None, dtype="float32", max_ctx=256, kv_quant="int8",
                 kv_options=replace(SPLIT, int8_rings=True))
    seq = np.array(prompts(cfg, seed=4)[0] + prompts(cfg, seed=5)[1], np.int32)[None]
    ref = full.logits(seq)[0]
    stepper = eng.core(1, 96, span=1)
    ring = stepper.state.cache.pools["sliding"]
    assert ring.k.dtype == jnp.int8 and ring.k_scale.shape == ring.k.shape[:-1]
    rows = []
    for t in range(seq.shape[1]):
        logits = stepper.step_logits(seq[:, t], np.array([t]))
        rows.append(np.asarray(logits)[0])
    # every layer's K/V int8: the E2B-like model's 3.3% (global layers alone) grows to 6.1%
    assert logit_err(np.stack(rows), ref) < INT8_LOGIT_TOL * (2 if make_cfg is gemma4_e2b else 1)
    ps = prompts(cfg)
    got = eng.generate_ids(ps, max_tokens=8)
    want = full.generate_ids(ps, max_tokens=8)
    assert sum(g.token_ids == w.token_ids for g, w in zip(got, want)) >= 1    # int8 may flip a late token
    with pytest.raises(ModelError, match="int8_rings"):
        KVOptions(int8_rings="yes")


def test_keys_rebuilt_from_values():
    """KVOptions(store_keys=False): the 31B-like model's k_eq_v global layers store V alone (half the
    global blocks' bytes) and rebuild keys from it (RMS norm, RoPE); token-by-token decode still
    gives the compute-dtype KV's logits, and greedy generation its tokens."""
    from dataclasses import replace
    cfg, full, stored, _ = engines(gemma4_31b)
    eng = Engine(cfg, full.weights, None, dtype="float32", max_ctx=256, kv_quant="int8",
                 kv_options=replace(SPLIT, store_keys=False))
    stepper = eng.core(1, 96, span=1)
    glob, both = stepper.state.cache.pools["global"], stored.core(1, 96).state.cache.pools["global"]
    assert glob.k is None and glob.k_scale is None and both.k.dtype == jnp.int8 and both.k.shape == glob.v.shape
    seq = np.array(prompts(cfg, seed=4)[0] + prompts(cfg, seed=5)[1], np.int32)[None]
    ref = full.logits(seq)[0]
    rows = []
    for t in range(seq.shape[1]):
        logits = stepper.step_logits(seq[:, t], np.array([t]))
        rows.append(np.asarray(logits)[0])
    assert logit_err(np.stack(rows), ref) < INT8_LOGIT_TOL
    ps = prompts(cfg)
    assert [g.token_ids for g in eng.generate_ids(ps, max_tokens=12)] == \
        [g.token_ids for g in full.generate_ids(ps, max_tokens=12)]
    with pytest.raises(ModelError, match="store_keys"):
        KVOptions(store_keys=1)


def _first_token_state(eng, tokens, lens, chunk):
    """The core's state after a prefill of right-padded prompts in chunks (one chunk: None)."""
    B, T = tokens.shape
    stepper = eng.core(B, 64)
    chunk = chunk or T
    firsts = []
    for s in range(0, T, chunk):
        length = np.clip(np.asarray(lens) - s, 0, chunk)
        rows = np.where(length > 0, np.arange(B), B)
        final = (length > 0) & (np.asarray(lens) - s <= chunk)
        pieces = Pieces.make(tokens[:, s:s + chunk], s, length, final, rows, max_new=4)
        firsts.append((final, np.asarray(stepper.prefill(pieces))))
    first = sum(np.where(f, t, 0) for f, t in firsts)
    return stepper.state, first


def logical_kv(state, name: str, row: int, n: int) -> np.ndarray:
    """Keys and values [2, layers, n, K, hd] of positions [0, n) of a row, read through its table."""
    pool, table = state.cache.pools[name], np.asarray(state.cache.tables[name])[row]
    P = pool.block_size
    blocks = table[(np.arange(n) // P) % table.shape[0]]
    return np.stack([np.asarray(a)[:, blocks, np.arange(n) % P] for a in (pool.k, pool.v)])


@pytest.mark.parametrize("int8", [False, True])
def test_chunked_prefill_matches_one_shot(int8):
    """Right-padded prompts prefilled in chunks shorter and longer than the window write the KV
    and draw the first tokens of one forward over each whole prompt."""
    cfg = tiny_gemma3(WINDOW)
    w = random_weights(cfg, 7)
    eng = Engine(cfg, w, None, dtype="float32", max_ctx=64, kv_quant="int8" if int8 else "none",
                 kv_options=KVOptions(block_size=8, read_block=16, prefill_chunk=48))
    assert eng.kv_layout.int8 == int8
    lens = [45, 29]
    tokens = pad_rows([p[:n] for p, n in zip(prompts(cfg, 8), lens)], 48, cfg.pad_id)
    one, first = _first_token_state(eng, tokens, lens, None)
    for chunk in (8, 24):                          # shorter and longer than the window
        st, f = _first_token_state(eng, tokens, lens, chunk)
        assert np.array_equal(f, first)
        assert np.array_equal(np.asarray(st.slots.last), np.asarray(one.slots.last))
        assert np.array_equal(np.asarray(st.slots.pos), lens)
        for name in one.cache.pools:
            for r, n in enumerate(lens):
                lo = 0 if name == "global" else n - WINDOW + 1      # what a sliding table still holds
                a, b = logical_kv(one, name, r, n), logical_kv(st, name, r, n)
                assert np.abs(a[:, :, lo:].astype(np.float32) - b[:, :, lo:].astype(np.float32)).max() < 1e-4, \
                    (name, chunk)


def test_pool_sizes_and_axes():
    """Blocks' bytes per kind (int8 with float32 scales; values alone where keys are rebuilt), the
    tables' widths (a sliding kind's: its window and what a call writes past it), the pools'
    logical axes, and the one-line error where they cannot fit."""
    import jax

    from jaxllm.config.axes import cache_leaf_axes
    from jaxllm.kv.paged import make_pools
    cfg = tiny_gemma4_like(WINDOW)
    layout = KVLayout(int8=True)
    specs = kind_specs(cfg, layout, KVOptions())
    glob = next(s for s in specs if s.name == "global")
    slid = next(s for s in specs if s.name == "sliding")
    assert glob.block_bytes(32, 2) == 32 * 1 * (32 + 4) * 2            # one global layer: int8 K, V + scales
    assert slid.block_bytes(32, 2) == 3 * 32 * 2 * 16 * 2 * 2          # three sliding layers in bfloat16
    plan = PoolPlan.for_rows([specs], layout, 32, 2, rows=3, max_len=1000, span=24)
    assert plan.widths == {"global": 32, "sliding": 3}       # 1000 positions; 15 + 24 of them, at any offset
    assert plan.blocks == {"global": 3 * 32 + 1, "sliding": 3 * 3 + 1}
    assert plan.total == plan.blocks["global"] * glob.block_bytes(32, 2) + plan.blocks["sliding"] * slid.block_bytes(32, 2)
    assert plan.sequences(1000) == 3 and plan.tokens == 3 * 32 * 32
    print(plan.describe())
    pools = jax.eval_shape(lambda: make_pools(specs, plan.blocks, 32, jnp.bfloat16, 64))
    assert pools["global"].v.shape == (1, 97, 32, 1, 32) and pools["global"].v.dtype == jnp.int8
    assert pools["global"].v_scale.shape == (1, 97, 32, 1)
    assert cache_leaf_axes(pools["global"].v.ndim) == ("layers", "blocks", "cache_seq", "kv_heads", "head_dim")
    with pytest.raises(RequestError, match="KV cache .* needs .* GiB"):
        check_fits(plan, free=plan.total - 1)
    rebuilt = kind_specs(cfg, layout, KVOptions(store_keys=False))
    assert next(s for s in rebuilt if s.name == "global").block_bytes(32, 2) * 2 == glob.block_bytes(32, 2)
    budget = PoolPlan.for_budget([specs], layout, 32, 2, rows=3, max_len=1000, span=24, budget=plan.total * 4)
    # the sliding blocks hold every slot's table twice over (the slots bind before they do), the
    # global kind the rest: four times the blocks of the slots at their longest, and more; a
    # decoding sequence holds two sliding blocks (its window's 15 positions and its next)
    assert budget.blocks["sliding"] == 2 * 3 * 3 + 1 and budget.blocks["global"] > 4 * 3 * 32
    assert budget.sequences(1000) == (2 * 3 * 3) // 2


def test_kv_options_and_context_checks():
    cfg = tiny_gemma3(WINDOW)
    w = random_weights(cfg)
    with pytest.raises(ModelError, match="kv_quant"):
        Engine(cfg, w, None, dtype="float32", max_ctx=64, kv_quant="fp8")
    with pytest.raises(ModelError, match="kv_quant"):
        jaxllm.load("/nonexistent", kv_quant="int4")
    with pytest.raises(ModelError, match="read_block"):
        KVOptions(read_block=0)
    with pytest.raises(ModelError, match="block_size"):
        KVOptions(block_size=24)
    with pytest.warns(UserWarning, match=f"max_ctx 8192 .* {cfg.max_position}"):
        eng = Engine(cfg, w, None, dtype="float32", max_ctx=8192, kv_options=SPLIT)
    assert eng.kv_layout == KVLayout(int8=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not Engine(cfg, w, None, dtype="float32", max_ctx=64, kv_options=SPLIT).kv_layout.int8


@pytest.mark.parametrize("front_end,flag", [("jaxllm.infer", "--max-ctx"), ("jaxllm.serve", "--max-model-len")])
def test_front_ends_warn_past_the_trained_context_and_refuse_a_cache_that_cannot_fit(front_end, flag, tmp_path):
    """One rule in every front end: a context past the model's trained length is a warning, and a
    KV cache the device cannot hold a one-line error."""
    import tiny
    tiny.make("gemma3", tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", front_end, "--model-dir", str(tmp_path), flag,
                        str(10 ** 12), "--kv-quant", "none", "--quant", "none"], capture_output=True, text=True,
                       timeout=300, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root})
    err = [line for line in r.stderr.strip().splitlines() if not line.startswith("INFO")]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert err[0].startswith("warning: max_ctx 1000000000000 is beyond the model's trained context of 512"), err
    assert "error: the KV cache for 1 x 1,000,000,000,000 tokens needs" in err[-1], err


# -- the embedded Gemma 3 270M ----------------------------------------------------------------------
GPL = "/usr/share/common-licenses/GPL-3"
PPL_WINDOW, PPL_STRIDE, PPL_CHUNK = 1536, 768, 768
# Sized for CI on two CPU cores (an 8192-token window costs minutes per pass there): one window;
# chunks of 768 exceed the model's 512-token sliding window, and reads of 256 take the int8
# global layers six steps per window.
PPL_TEXT_TOKENS = PPL_WINDOW - 1
INT8_PPL_OPTIONS = KVOptions(read_block=256, prefill_chunk=PPL_CHUNK)


@pytest.fixture(scope="module")
def gemma270m():
    return jaxllm.load(max_ctx=PPL_WINDOW, kv_quant="none")


def perplexity(eng, ids: list[int]) -> float:
    """Sliding-window perplexity through the engine core, under `eng`'s KV layout."""
    return perplexity_ids(eng, ids, PPL_WINDOW, PPL_STRIDE).ppl


@pytest.mark.slow
def test_gemma270m_int8_kv_perplexity(gemma270m):
    eng = gemma270m
    ids = eng.tokenizer.encode(open(GPL).read())
    ids = [t for t in ids if t != eng.cfg.bos_id][:PPL_TEXT_TOKENS]
    int8 = Engine(eng.cfg, eng.weights, eng.tokenizer, max_ctx=PPL_WINDOW, kv_quant="int8",
                  kv_options=INT8_PPL_OPTIONS)
    assert not eng.kv_layout.int8 and int8.kv_layout == KVLayout(int8=True)
    p_ref, p_int8 = perplexity(eng, ids), perplexity(int8, ids)
    print(f"GPL-3, {len(ids)} tokens, window {PPL_WINDOW} stride {PPL_STRIDE}: "
          f"ppl bf16 KV {p_ref:.4f}, int8 KV {p_int8:.4f} ({100 * (p_int8 / p_ref - 1):+.3f}%)")
    assert 1.0 < p_ref < 100
    assert abs(p_int8 / p_ref - 1) < 0.01


@pytest.mark.slow
def test_gemma270m_answers_at_128k_context(gemma270m, capsys):
    eng = gemma270m
    with pytest.warns(UserWarning, match=f"max_ctx 131072 .* {eng.cfg.max_position}"):
        long = Engine(eng.cfg, eng.weights, eng.tokenizer, max_ctx=131072, kv_options=KVOptions(prefill_chunk=1024))
    assert long.kv_layout == KVLayout(int8=True)
    plan = long.pool_plan(1, 131072, span=1024)
    print(plan.describe())
    assert plan.total < 400 * 2**20          # 3 int8 global layers, and 15 sliding ones' window, for 128K tokens
    text = open(GPL).read()
    body = eng.tokenizer.decode(eng.tokenizer.encode(text)[1:2900])
    prompt = body + "\n\nWhat is the name of the license above?"
    out = long.generate([prompt], max_tokens=24)[0]
    print(f"{len(out.prompt_token_ids)} prompt tokens -> {out.text!r}")
    assert len(out.prompt_token_ids) > 2900 and out.token_ids
    assert "GNU" in out.text or "General Public" in out.text
