"""Logits of tiny transformers checkpoints, loaded through the normal HF-directory path."""
import numpy as np
import pytest
import tiny

import jaxllm

CASES = {
    "qwen3-untied": ("qwen3", dict(tie_word_embeddings=False)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "gemma3": ("gemma3", dict(final_logit_softcapping=30.0)),
    "gemma3-no-final-softcap": ("gemma3", dict(final_logit_softcapping=None, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    family, over = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    model = tiny.make(family, d, seed=len(request.param), **over)
    return model, jaxllm.load(str(d), quant="none", dtype="float32", max_ctx=256)


def test_equal_rows(pair):
    model, eng = pair
    ids = np.random.default_rng(1).integers(0, eng.cfg.vocab_size, (2, 37)).astype(np.int32)
    err = tiny.rel_err(eng.logits(ids), tiny.hf_logits(model, ids))
    assert err < 1e-4, err


def test_right_padded_rows(pair):
    """Rows of unequal length, right-padded: each row's valid logits match that row run alone."""
    model, eng = pair
    rng = np.random.default_rng(2)
    lengths = [29, 11, 20]           # 29 > 3x the sliding window of 8
    ids = np.zeros((3, 29), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(1, eng.cfg.vocab_size, n)
    got = eng.logits(ids, lengths=np.array(lengths))
    for b, n in enumerate(lengths):
        ref = tiny.hf_logits(model, ids[b:b + 1, :n])[0]
        assert tiny.rel_err(got[b, :n], ref) < 1e-4


def test_config_detection(pair):
    model, eng = pair
    assert eng.cfg.num_layers == model.config.num_hidden_layers
    if eng.cfg.family == "gemma3":
        assert eng.cfg.layer_kinds == tuple(0 if t == "sliding_attention" else 1
                                            for t in model.config.layer_types)
