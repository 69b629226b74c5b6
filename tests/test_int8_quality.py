"""int8 weights on a real model (the embedded Gemma 3 270M): perplexity within 3% of bf16 weights,
and greedy continuations that mostly agree."""
import os

import numpy as np
import pytest

import jaxllm

TEXT = "/usr/share/common-licenses/GPL-3"
WINDOW, STRIDE, N_TOKENS = 1024, 512, 3000
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]


def perplexity(eng, ids, window=WINDOW, stride=STRIDE):
    """The sliding-window protocol: each window gets a fresh BOS, tokens scored by an earlier window
    are context only, PPL = exp(mean NLL over all scored tokens)."""
    bos = eng.cfg.bos_id
    nll, n, scored = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window - 1, len(ids))
        chunk = [bos] + ids[begin:end]
        logits = eng.logits(np.asarray([chunk], np.int32))[0].astype(np.float64)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        targets = np.asarray(chunk[1:])
        tok_lp = logp[np.arange(len(targets)), targets]
        new = max(end - max(scored, begin), 0)        # score only tokens not scored before
        if new:
            nll -= tok_lp[-new:].sum()
            n += new
        scored = end
        if end == len(ids):
            break
    return float(np.exp(nll / n)), n


@pytest.fixture(scope="module")
def engines():
    return {q: jaxllm.load(None, quant=q, max_ctx=WINDOW) for q in ("none", "int8")}


@pytest.mark.slow
def test_int8_perplexity_within_3_percent(engines):
    with open(TEXT) as f:
        ids = engines["none"].tokenizer.encode(f.read(), add_special=False)[:N_TOKENS]
    ppl = {q: perplexity(e, ids) for q, e in engines.items()}
    print(f"GPL-3, {ppl['none'][1]} tokens: bf16 PPL {ppl['none'][0]:.3f}, int8 PPL {ppl['int8'][0]:.3f} "
          f"({100 * (ppl['int8'][0] / ppl['none'][0] - 1):+.2f}%)")
    assert abs(ppl["int8"][0] / ppl["none"][0] - 1) < 0.03


@pytest.mark.slow
def test_int8_greedy_mostly_agrees(engines):
    agree = []
    for p in PROMPTS:
        a = engines["none"].generate([p], max_tokens=16)[0].token_ids
        b = engines["int8"].generate([p], max_tokens=16)[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree.append(same)
        print(f"{p!r}: first {same} of 16 greedy tokens identical")
    assert sum(agree) >= 0.6 * 16 * len(PROMPTS)
