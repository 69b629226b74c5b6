"""int8 weights on a real model (the embedded Gemma 3 270M): perplexity within 3% of bf16 weights,
and greedy continuations that mostly agree."""
import pytest

import jaxllm
from jaxllm.harness.perplexity import perplexity_ids

TEXT = "/usr/share/common-licenses/GPL-3"
WINDOW, STRIDE, N_TOKENS = 1024, 512, 3000
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]


@pytest.fixture(scope="module")
def engines():
    return {q: jaxllm.load(None, quant=q, max_ctx=WINDOW) for q in ("none", "int8")}


@pytest.mark.slow
def test_int8_perplexity_within_3_percent(engines):
    with open(TEXT) as f:
        ids = engines["none"].tokenizer.encode(f.read(), add_special=False)[:N_TOKENS]
    ppl = {q: perplexity_ids(e, ids, WINDOW, STRIDE) for q, e in engines.items()}
    bf16, int8 = ppl["none"].ppl, ppl["int8"].ppl
    print(f"GPL-3, {ppl['none'].num_scored_tokens} tokens: bf16 PPL {bf16:.3f}, int8 PPL {int8:.3f} "
          f"({100 * (int8 / bf16 - 1):+.2f}%)")
    assert abs(int8 / bf16 - 1) < 0.03


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
