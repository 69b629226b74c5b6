"""Top-k / top-p filtering against a float64 numpy reference, by both ways of finding the cut-off
(the sort used on GPUs, the bisection used elsewhere), and the draw staying inside what is kept."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.sampling import SamplingParams, filtered, sample


def reference_keep(logits, temperature, top_k, top_p):
    """Kept tokens of one row, or None where top-p's decision sits within float32 rounding of a
    value's boundary (summation order may then decide either way)."""
    s = logits / np.float32(temperature if temperature > 0 else 1.0)
    V = len(s)
    kth = np.sort(s)[::-1][(min(top_k, V) if top_k > 0 else V) - 1]
    if top_p >= 1:
        return s >= kth
    e = np.where(s >= kth, np.exp(s.astype(np.float64) - s.max()), 0.0)
    budget = top_p * e.sum()
    for v in np.unique(s[s >= kth])[::-1]:              # descending: the first value reaching it
        mass = e[s >= v].sum()
        if abs(mass - budget) < 1e-5 * e.sum():
            return None
        if mass >= budget:
            return s >= v
    raise AssertionError("top_p < 1 always reaches its budget")


def random_rows(rng, trial):
    V = int(rng.choice([7, 50, 1000, 4099]))
    logits = (rng.normal(size=(4, V)) * rng.uniform(0.1, 10)).astype(np.float32)
    if trial % 3 == 0:
        logits = np.round(logits)                      # ties, and -0.0 beside 0.0
    if trial % 5 == 0:
        logits[:, :V // 3] = -np.inf                   # tokens a model rules out
    params = (rng.choice([0.0, 0.5, 1.0, 2.0], 4), rng.choice([0, 1, 3, 40, V, V + 5], 4),
              rng.choice([1.0, 0.9, 0.5, 0.01, 0.999], 4).astype(np.float32))
    return logits, params


@pytest.mark.parametrize("by", ["bisection", "sort"])
def test_filter_matches_reference(by):
    rng = np.random.default_rng(1)
    f = jax.jit(partial(filtered, by=by))
    checked = 0
    for trial in range(150):
        logits, (temp, top_k, top_p) = random_rows(rng, trial)
        p = SamplingParams(jnp.asarray(temp, jnp.float32), jnp.asarray(top_k, jnp.int32),
                           jnp.asarray(top_p, jnp.float32), jnp.zeros(4, jnp.uint32))
        out = np.asarray(f(jnp.asarray(logits), p))
        for r in range(4):
            want = reference_keep(logits[r], temp[r], int(top_k[r]), float(top_p[r]))
            if want is None:
                continue
            want &= np.isfinite(logits[r])
            assert np.array_equal(np.isfinite(out[r]), want), (trial, r, temp[r], top_k[r], top_p[r])
            kept = np.isfinite(out[r])
            assert np.allclose(out[r][kept], logits[r][kept] / (temp[r] if temp[r] > 0 else 1), rtol=1e-6)
            checked += 1
    assert checked > 550                               # of 600 rows; only boundary ties are left out


def test_top_p_one_keeps_the_tail():
    """top_p = 1 filters nothing, however small the tail's share (a float32 running sum reaches 1
    before it)."""
    logits = jnp.asarray([[30.0, 0.0, -5.0, -40.0]])
    p = SamplingParams.make(1, 1.0, None, 1.0)
    for by in ("bisection", "sort"):
        assert np.isfinite(np.asarray(filtered(logits, p, by=by))).all()


def test_draws_stay_inside_the_kept_tokens():
    logits = jax.random.normal(jax.random.key(0), (3, 500)) * 2
    p = SamplingParams.make(3, 0.7, 20, 0.8)
    kept = np.isfinite(np.asarray(filtered(logits, p)))
    assert 1 < kept.sum(axis=1).min() and kept.sum(axis=1).max() <= 20
    draw = jax.jit(sample)
    seen = np.array([np.asarray(draw(logits, p, jnp.int32(i))) for i in range(200)])
    assert all(kept[r, seen[:, r]].all() for r in range(3))
    assert min(len(set(seen[:, r])) for r in range(3)) > 1          # it does sample, not argmax
