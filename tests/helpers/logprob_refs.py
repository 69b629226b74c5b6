"""Checks of a server's log-probabilities against log_softmax of `Engine.logits` at the same
positions (the model's raw distribution, which the server reports)."""
from __future__ import annotations

import numpy as np

ATOL = 1e-4


def log_softmax(engine, ids: list[int]) -> np.ndarray:
    """[len(ids), V] float64: row i is the distribution of the token after ids[i]."""
    x = np.asarray(engine.logits(np.array([ids], np.int32))[0], np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def token_text(engine, i: int) -> str:
    return engine.tokenizer.decode([int(i)], skip_special=False)


def check_completion(engine, lp: dict, ids: list[int], start: int, n: int):
    """Completions `logprobs` of tokens ids[start:] (start 0: the echoed prompt's first has none),
    with n alternatives each."""
    want = log_softmax(engine, ids)
    toks = ids[start:]
    assert lp["tokens"] == [token_text(engine, t) for t in toks]
    assert lp["text_offset"] == np.cumsum([0] + [len(s) for s in lp["tokens"]])[:-1].tolist()
    for k, t in enumerate(toks):
        i = start + k
        if i == 0:
            assert lp["token_logprobs"][k] is None and lp["top_logprobs"][k] is None
            continue
        row = want[i - 1]
        np.testing.assert_allclose(lp["token_logprobs"][k], row[t], atol=ATOL)
        allowed: dict[str, list[float]] = {}          # the token and the n most likely, by their text
        for j in [t] + np.argsort(-row, kind="stable")[:n].tolist():
            allowed.setdefault(token_text(engine, j), []).append(row[j])
        top = lp["top_logprobs"][k]
        assert set(top) == set(allowed), (top, allowed)
        for s, v in top.items():
            assert np.min(np.abs(np.asarray(allowed[s]) - v)) <= ATOL, (s, v, allowed[s])


def check_chat(engine, content: list[dict], ids: list[int], start: int, n: int):
    """Chat `logprobs.content` of tokens ids[start:] (start >= 1), with n alternatives each."""
    want = log_softmax(engine, ids)
    assert len(content) == len(ids) - start
    for k, c in enumerate(content):
        i, t = start + k, ids[start + k]
        row = want[i - 1]
        assert c["token"] == token_text(engine, t) and c["bytes"] == list(c["token"].encode())
        np.testing.assert_allclose(c["logprob"], row[t], atol=ATOL)
        best = np.argsort(-row, kind="stable")[:n]
        assert [a["token"] for a in c["top_logprobs"]] == [token_text(engine, j) for j in best]
        np.testing.assert_allclose([a["logprob"] for a in c["top_logprobs"]], row[best], atol=ATOL)


def joined(chunks: list[dict], kind: str) -> dict | list:
    """The log-probabilities of a stream's chunks (JSON dicts) put together."""
    lps = [c["choices"][0]["logprobs"] for c in chunks if c.get("choices") and c["choices"][0]["logprobs"]]
    if kind == "chat":
        return [e for lp in lps for e in lp["content"]]
    return {k: [v for lp in lps for v in lp[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def check_prompt_logprobs(engine, entries: list, ids: list[int], n: int):
    """vLLM's `prompt_logprobs` of prompt `ids`: None first, then per token {id: {logprob, rank,
    decoded_token}} holding the token and the n most likely ones, ranked from 1."""
    want = log_softmax(engine, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row, got = want[i - 1], entries[i]
        order = np.argsort(-row, kind="stable")
        best = order[:n].tolist()
        assert set(got) == {str(t) for t in [ids[i], *best]}, (i, got)
        for t in {ids[i], *best}:
            e = got[str(t)]
            np.testing.assert_allclose(e["logprob"], row[t], atol=ATOL)
            assert e["decoded_token"] == token_text(engine, t)
            rank = int(np.sum(row > row[t] + ATOL)) + 1
            assert e["rank"] in ((rank, None) if t not in best else (rank,)), (i, t, e, rank)
