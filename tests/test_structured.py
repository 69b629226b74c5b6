"""Structured output: the grammar mask on the device (`sampling.mask_tokens`, the core's masked
prefill and decode beside speculation)."""
from __future__ import annotations

import numpy as np

import jaxllm


# -- the mask on the device -------------------------------------------------------------------------
def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [N, V] -> the packed mask [N, ceil(V / 32)] uint32 (bit j of word w: token 32 w + j)."""
    N, V = allowed.shape
    bits = np.zeros((N, -(-V // 32) * 32), bool)
    bits[:, :V] = allowed
    return np.packbits(bits, axis=1, bitorder="little").view(np.uint32)


def test_mask_tokens_keeps_exactly_the_allowed_tokens():
    import jax.numpy as jnp

    from jaxllm.sampling import SamplingParams, mask_tokens, sample
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    allowed = rng.random((3, 70)) < 0.2
    allowed[2] = True                                   # a free row: its logits come back exactly
    got = np.asarray(mask_tokens(jnp.asarray(logits), jnp.asarray(pack(allowed))))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))
    greedy = np.asarray(sample(jnp.asarray(got), SamplingParams.make(3), 0))
    assert greedy.tolist() == np.argmax(np.where(allowed, logits, -np.inf), -1).tolist()
    drawn = np.asarray(sample(jnp.asarray(got), SamplingParams.make(3, temperature=1.0, seed=3), 0))
    assert all(allowed[b, t] for b, t in enumerate(drawn))


def test_masked_rows_sample_only_allowed_tokens_beside_speculation(tmp_path):
    """On a tiny random Qwen3 with n-gram speculation: row 0 is constrained to a few tokens from
    its first token on (the prefill samples it) and drafts nothing, one token a block; row 1 runs
    free beside it in the same blocks, takes drafts, and gets the greedy tokens of plain decoding."""
    import tiny

    from jaxllm.core import Pieces
    from jaxllm.engine import Engine
    from jaxllm.sampling import SamplingParams
    from jaxllm.speculative import Speculation
    tiny.make("qwen3", tmp_path)
    base = jaxllm.load(str(tmp_path), quant="none", dtype="float32", max_ctx=256)
    eng = Engine(base.cfg, base.weights, base.tokenizer, dtype="float32", max_ctx=256,
                 speculation=Speculation("ngram", 3))
    prompt = [5, 6, 7, 8] * 6                            # repetitive: the n-gram lookup finds drafts
    free = base.generate_ids([prompt], max_tokens=12)[0].token_ids
    ok = np.zeros((2, eng.cfg.vocab_size), bool)
    ok[0, [11, 23, 42]] = True
    ok[1] = True
    allowed = pack(ok)
    core = eng.core(2, 64)
    first = core.prefill(Pieces.make(np.asarray([prompt, prompt], np.int32), 0, len(prompt), True, [0, 1],
                                     SamplingParams.make(2), 64, False, allowed=allowed))
    rows = [[int(t)] for t in eng.layout.get(first)]
    most = 0
    while len(rows[1]) < len(free):
        toks, count, _ = core.decode(1, core.out_size(1), allowed=allowed)
        toks, count = eng.layout.get(toks), eng.layout.get(count)
        assert count[0] == 1
        most = max(most, count[1])
        for b in range(2):
            rows[b] += toks[b, :count[b]].tolist()
    assert set(rows[0]) <= {11, 23, 42}
    assert rows[1][:len(free)] == free
    assert most > 1                                      # the free row took drafts
