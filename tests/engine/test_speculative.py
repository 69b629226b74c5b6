"""Speculative decoding: greedy output identical to plain decoding (n-gram drafts and a draft
model, full-length and split caches, rows that accept different counts in one batch), and sampled
output distributed exactly as plain sampling's."""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import pytest
import tiny

import jaxllm
from jaxllm.engine.engine import Engine
from jaxllm.engine.speculative import Speculation, ngram_draft

# Python source as a prompt that repeats itself (the first 2787 characters of jaxllm's sampling
# module as it was when these lengths were chosen: 1000 tokens with the line after it), kept here so
# that edits to the module leave it be
CODE = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "speculative_code.txt")).read()
FREE = ("The river valley was quiet in the early morning. A heron stood in the shallows, and far off a "
        "dog barked twice. Write a short story about what happens next in the valley, in your own words.")


def test_ngram_lookup_takes_the_latest_longest_match():
    import jax.numpy as jnp
    h = jnp.asarray([[5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7, 0, 0, 0, 0]], jnp.int32)
    # last tokens "6 7" at position 11: "6 7" ended at 2 and 7; the latest (7) is followed by 1 2 6 7
    drafts, n = ngram_draft(h, jnp.asarray([11]), 4, (1, 3))
    assert drafts.tolist() == [[1, 2, 6, 7]] and n.tolist() == [4]
    # "5 6 7" (3-gram) at position 7 matched at 2, followed by 8 9 5; only 4 tokens lie before 7
    drafts, n = ngram_draft(h, jnp.asarray([7]), 6, (1, 3))
    assert drafts[0, :5].tolist() == [8, 9, 5, 6, 7] and n.tolist() == [5]
    drafts, n = ngram_draft(h, jnp.asarray([4]), 3, (1, 3))                 # 9 never seen before
    assert n.tolist() == [0]


@lru_cache(maxsize=None)
def engines(kv_quant: str):
    """The embedded model in float32 (plain, n-gram speculation), sharing its weights."""
    base = jaxllm.load(None, max_ctx=MAX_CTX, quant="none", dtype="float32", kv_quant=kv_quant)
    spec = Engine(base.cfg, base.weights, base.tokenizer, dtype="float32", max_ctx=MAX_CTX, kv_quant=kv_quant,
                  speculation=Speculation("ngram", 4))
    return base, spec


NEW = 64              # from the code prompt's 1000 tokens past position 1032: the split cache's rings (512
                      # slots, 516 with the drafts beside them) wrap the second time while it decodes
MAX_CTX = 1088


def prompts(kv_quant: str) -> list[str]:
    """A code prompt that repeats itself, in a batch with one that does not. The split cache's is
    the whole 1000 tokens, for its rings to wrap; the full-length cache has no ring, and its code
    prompt is the first 271 tokens of that."""
    code = CODE if kv_quant == "int8" else CODE[:CODE.rfind("\n", 0, 900)]
    return [code + "\n\n# The same code again:\n", FREE]


@lru_cache(maxsize=None)
def plain_answers(kv_quant: str):
    """NEW new tokens of each prompt without speculation, and the plain decode rate."""
    base, _ = engines(kv_quant)
    want = base.generate(prompts(kv_quant), max_tokens=NEW, chat=False)
    return want, (base.stats.new_tokens - 2) / base.stats.decode_s


@pytest.mark.slow
@pytest.mark.parametrize("kv_quant", ["none", "int8"])
def test_greedy_speculation_is_plain_decoding(kv_quant):
    """64 new tokens after a code prompt (with int8 global layers 1000 tokens: the sliding layers'
    tables of the 512-position window are reused twice over), in a batch with a row that finds
    little to look up, and with int8 global layers alone too."""
    base, spec = engines(kv_quant)
    assert base.kv_layout.int8 == (kv_quant == "int8")
    batch = prompts(kv_quant)
    want, plain_tok_s = plain_answers(kv_quant)
    got = spec.generate(batch, max_tokens=NEW, chat=False)
    st = spec.stats
    print(f"{base.kv_layout.name}: {st.spec}, decode {(st.new_tokens - 2) / st.decode_s:.1f} tok/s against "
          f"{plain_tok_s:.1f} plain")
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert len(got[0].prompt_token_ids) == (1000 if kv_quant == "int8" else 271) and len(want[0].token_ids) == NEW
    assert st.spec["accepted"] > 0
    if kv_quant == "int8":
        alone = spec.generate(batch[1:], max_tokens=64, chat=False)[0]
        assert alone.token_ids == want[1].token_ids[:64]


@pytest.mark.slow
def test_greedy_speculation_with_a_draft_model(tmp_path):
    """A tiny random draft model sharing the vocabulary proposes nonsense: the 64 tokens of each
    row (in a batch) are the plain output all the same."""
    base, _ = engines("none")
    tiny.make("gemma3", tmp_path, seed=2, vocab_size=base.cfg.vocab_size, num_hidden_layers=2)
    from jaxllm.weights.loader import load_model
    dcfg, _, dweights, _, _ = load_model(str(tmp_path), base.dtype, "none")
    eng = Engine(base.cfg, base.weights, base.tokenizer, dtype="float32", max_ctx=MAX_CTX,
                 speculation=Speculation("draft", 3, draft_cfg=dcfg), draft_weights=dweights)
    want, _ = plain_answers("none")
    got = eng.generate(prompts("none"), max_tokens=NEW, chat=False)
    print("draft model:", eng.stats.spec)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert eng.stats.spec["drafted"] > 0


# -- the distribution under sampling ---------------------------------------------------------------
SEEDS = 3000
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]           # its last tokens recur: n-gram drafts exist


@lru_cache(maxsize=None)
def small_vocab_model(path):
    tiny.make("qwen3", path, seed=4, vocab_size=8)
    return jaxllm.load(str(path), quant="none", dtype="float32", max_ctx=32)


def sampled(eng, seeds=SEEDS) -> np.ndarray:
    """The first three tokens of the prompt sampled under `seeds` seeds, one row each -> [seeds, 3]."""
    from jaxllm.engine.sampling import SamplingParams
    ids = [PROMPT] * seeds
    eng_core = eng.core(seeds, 32)
    params = SamplingParams(np.ones(seeds, np.float32), np.zeros(seeds, np.int32), np.ones(seeds, np.float32),
                            np.arange(seeds, dtype=np.uint32), np.zeros(seeds, np.float32))
    first = eng_core.prefill_prompts(ids, params, np.full(seeds, 3, np.int32), np.ones(seeds, bool))
    rest, count, _ = eng_core.run_to_completion(2)
    assert (count == 2).all()
    sampled.stats = eng_core.spec_stats()
    return np.concatenate([first[:, None], rest[:, :2]], axis=1)


def chi2_same(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of a chi-square test that two samples of token triples share one distribution."""
    from scipy.stats import chi2_contingency
    keys = sorted(set(map(tuple, a)) | set(map(tuple, b)))
    index = {k: i for i, k in enumerate(keys)}
    table = np.zeros((2, len(keys)))
    for row, sample in enumerate((a, b)):
        for t in map(tuple, sample):
            table[row, index[t]] += 1
    table = table[:, table.sum(0) >= 5]             # the test wants expected counts of 5 or more
    return float(chi2_contingency(table)[1])


def test_sampled_distribution_is_unchanged(tmp_path_factory, monkeypatch):
    """At temperature 1 on a model of 8 tokens, the first 3 tokens of 3000 seeds with n-gram
    speculation (drafts accepted with probability p, rejections resampled from p without the
    draft) against 3000 without: a chi-square test must not tell them apart at the 0.1% level,
    and does tell apart a rule that accepts every draft."""
    base = small_vocab_model(tmp_path_factory.mktemp("v8"))
    # every row drafts whatever it accepts, at any batch: exactness must not rest on the off-switch
    spec = Engine(base.cfg, base.weights, None, dtype="float32", max_ctx=32, speculation=Speculation("ngram", 2, min_accept=0.0, max_batch=None))
    plain, specd = sampled(base), sampled(spec)
    stats = sampled.stats
    p = chi2_same(plain, specd)
    print(f"p = {p:.3f}; distinct triples {len(set(map(tuple, plain)))}; speculation {stats}")
    assert stats["drafted"] > 1000 and 0 < stats["accepted"] < stats["drafted"]
    assert p > 1e-3

    from jaxllm.engine import step

    def always_accept(logits, drafts, n_draft, params, step_, by="bisection"):    # a wrong rule: a test double
        a, nxt = real(logits, drafts, n_draft, params, step_, by)
        return n_draft, nxt
    real = step.accept
    monkeypatch.setattr(step, "accept", always_accept)
    wrong = Engine(base.cfg, base.weights, None, dtype="float32", max_ctx=32, speculation=Speculation("ngram", 2, min_accept=0.0, max_batch=None))
    assert chi2_same(plain, sampled(wrong)) < 1e-6


def test_token_rules_in_verify_cycles(tmp_path_factory):
    """logit_bias, stop_token_ids and min_tokens (EOS kept back until then) inside speculative
    cycles, every row drafting every cycle: the greedy answers are plain decoding's with the same
    rules, token for token, where each rule changes the answers."""
    import dataclasses
    model = small_vocab_model(tmp_path_factory.mktemp("v8"))
    cfg = dataclasses.replace(model.cfg, eos_ids=(7,))
    plain = Engine(cfg, model.weights, None, dtype="float32", max_ctx=32)
    spec = Engine(cfg, model.weights, None, dtype="float32", max_ctx=32,
                  speculation=Speculation("ngram", 2, min_accept=0.0, max_batch=None))
    prompts = [PROMPT, [4, 5, 4, 5, 4, 5, 4]]
    free = [c.token_ids for c in plain.generate_ids(prompts, max_tokens=16)]
    for rules in ({"logit_bias": {3: 2.0, 1: -100}}, {"min_tokens": 12}, {"stop_token_ids": [4], "min_tokens": 3},
                  {"stop_token_ids": [2], "min_tokens": 5}):
        want = plain.generate_ids(prompts, max_tokens=16, **rules)
        got = spec.generate_ids(prompts, max_tokens=16, **rules)
        print(rules, [c.token_ids for c in want], [c.finish_reason for c in want], spec.stats.spec)
        assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in want]
        assert [c.token_ids for c in want] != free and spec.stats.spec["drafted"] > 0
