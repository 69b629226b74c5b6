"""Min-p / top-k / top-p filtering against a float64 numpy reference, by both ways of finding the cut-off
(the sort used on GPUs, the bisection used elsewhere), and the draw staying inside what is kept."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.engine import sampling
from jaxllm.engine.sampling import SamplingParams, _row_keys, filtered, sample


def reference_keep(logits, temperature, top_k, top_p, min_p=0.0):
    """Kept tokens of one row (vLLM's order: temperature, min-p, then top-k and top-p), or None
    where min-p's or top-p's decision sits within float32 rounding of a value's boundary
    (summation order may then decide either way)."""
    s = logits / np.float32(temperature if temperature > 0 else 1.0)
    V = len(s)
    floor = -np.inf
    if min_p > 0:
        p = np.exp(s.astype(np.float64) - s.max())       # probabilities relative to the likeliest
        if np.any(np.abs(p - min_p) < 1e-5 * min_p):
            return None
        floor = s[p >= min_p].min()
    kth = max(np.sort(s)[::-1][(min(top_k, V) if top_k > 0 else V) - 1], floor)
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
              rng.choice([1.0, 0.9, 0.5, 0.01, 0.999], 4).astype(np.float32),
              rng.choice([0.0, 0.0, 0.05, 0.3], 4).astype(np.float32))
    return logits, params


def params_of(temp, top_k, top_p, seeds, min_p) -> SamplingParams:
    return SamplingParams(jnp.asarray(temp, jnp.float32), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32),
                          jnp.asarray(seeds, jnp.uint32), jnp.asarray(min_p, jnp.float32))


@pytest.mark.parametrize("by", ["bisection", "sort"])
def test_filter_matches_reference(by):
    rng = np.random.default_rng(1)
    f = jax.jit(partial(filtered, by=by))
    checked = 0
    for trial in range(150):
        logits, (temp, top_k, top_p, min_p) = random_rows(rng, trial)
        p = params_of(temp, top_k, top_p, np.zeros(4), min_p)
        out = np.asarray(f(jnp.asarray(logits), p))
        for r in range(4):
            want = reference_keep(logits[r], temp[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
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


@pytest.mark.parametrize("by", ["bisection", "sort"])     # what CPUs and TPUs use, what GPUs use
def test_a_draw_is_the_categorical_draw_from_the_filtered_logits(by):
    """`sample` never builds the top-p mask, and finds top-k cut-offs up to 128 without a sort (on
    GPUs, `by="sort"`), yet draws token for token what `jax.random.categorical` draws from
    `filtered`'s logits with the same key: with top-p alone, and with top-k (some rows above 128)
    in the batch."""
    rng = np.random.default_rng(2)
    draw, same = jax.jit(partial(sample, by=by)), 0
    cut_then_draw = jax.jit(lambda x, p, s: jax.vmap(jax.random.categorical)(_row_keys(p, s),
                                                                           filtered(x, p, by=by)))
    for trial in range(40):
        logits, (temp, top_k, top_p, min_p) = random_rows(rng, trial)
        if trial % 2:
            top_k = np.where(top_k < logits.shape[-1], 0, top_k)
        elif trial % 4 == 2:
            top_k = rng.choice([100, 129, 200, 128], 4)
        p = params_of(temp, top_k, top_p, np.arange(4) + trial, min_p)
        for step in range(3):
            got = np.asarray(draw(jnp.asarray(logits), p, jnp.int32(step)))
            want = np.asarray(cut_then_draw(jnp.asarray(logits), p, jnp.int32(step)))
            for r in range(4):
                if temp[r] == 0:
                    assert got[r] == np.argmax(logits[r])
                elif reference_keep(logits[r], temp[r], int(top_k[r]), float(top_p[r]), float(min_p[r])) is not None:
                    assert got[r] == want[r], (trial, step, r)
                    same += 1
    assert same > 250


def test_the_backend_picks_the_cut_off_search():
    """GPUs sort (`by="sort"`), every other device bisects; the backend says which."""
    from jaxllm import RuntimeConfig, ops
    for kernels in ("auto", "xla", "pallas"):
        assert ops.select(RuntimeConfig(kernels=kernels)).top_p_by == (
            "sort" if jax.default_backend() == "gpu" else "bisection")


def test_kth_from_the_blocks_with_the_largest_maxima():
    rng = np.random.default_rng(3)
    for trial in range(30):
        V = int(rng.choice([5, 64, 127, 128, 300, 1000]))
        x = (rng.normal(size=(3, V)) * 3).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x)                              # ties
        if trial % 4 == 0:
            x[:, rng.integers(0, V, V // 2)] = -np.inf
        cap, width = [(128, 128), (4, 8), (16, 5)][trial % 3]
        k = rng.integers(1, min(cap, V) + 1, 3)
        got = np.asarray(sampling._kth_from_blocks(jnp.asarray(x), jnp.asarray(k, jnp.int32), cap, width))[:, 0]
        want = [np.sort(x[r])[::-1][k[r] - 1] for r in range(3)]
        assert np.array_equal(got, want), (trial, V, cap, width, k)


def test_draws_follow_the_renormalized_top_k_top_p_set():
    """The rejection sampler draws each kept token in proportion to its probability, and nothing
    else, for top-p alone and after a top-k cut (20,000 draws a row, a 12-token vocabulary)."""
    V, N = 12, 20000
    logits = jnp.asarray((np.random.default_rng(0).normal(size=(4, V)) * 2).astype(np.float32))
    p = params_of([0.8, 1.3, 0.8, 0.5], [0, 0, 0, 4], [0.6, 0.95, 1.0, 0.8], [3, 4, 5, 6], [0.0, 0.0, 0.2, 0.0])
    kept = np.isfinite(np.asarray(filtered(logits, p)))
    assert [int(n) for n in kept.sum(1)] != [V] * 4 and kept.sum(1).min() > 1
    toks = np.asarray(jax.jit(jax.vmap(lambda i: sample(logits, p, i)))(jnp.arange(N)))
    for r in range(4):
        s = np.asarray(logits[r], np.float64) / float(p.temperature[r])
        want = np.where(kept[r], np.exp(s - s.max()), 0.0)
        want /= want.sum()
        got = np.bincount(toks[:, r], minlength=V) / N
        assert got[~kept[r]].sum() == 0, r
        assert np.all(np.abs(got - want) <= 5 * np.sqrt(want * (1 - want) / N) + 1e-3), (r, got, want)


def test_a_row_draws_the_same_whatever_shares_its_batch():
    """A top-p row's tokens depend on its own seed alone: beside a top-k row and a greedy row
    (which send the batch through the top-k cut-off) it draws what it draws alone."""
    logits = jax.random.normal(jax.random.key(1), (3, 300)) * 1.5
    alone = SamplingParams.make(1, 1.2, None, 0.5, seed=7)
    mixed = params_of([1.2, 0.7, 0.0], [0, 5, 0], [0.5, 0.9, 1.0], [7, 1, 2], [0.0, 0.1, 0.0])
    draw = jax.jit(sample)
    a = [int(draw(logits[:1], alone, jnp.int32(i))[0]) for i in range(60)]
    m = np.array([np.asarray(draw(logits, mixed, jnp.int32(i))) for i in range(60)])
    assert a == m[:, 0].tolist() and len(set(a)) > 3
    assert (m[:, 2] == int(jnp.argmax(logits[2]))).all()


def test_nan_logits_end_the_draw():
    """Logits a broken model turns to NaN give some token, never a loop that does not end."""
    logits = jnp.asarray([[np.nan, 1.0, 2.0, np.nan], [np.nan] * 4], jnp.float32)
    out = np.asarray(jax.jit(sample)(logits, SamplingParams.make(2, 1.0, None, 0.9), jnp.int32(0)))
    assert out.shape == (2,) and ((0 <= out) & (out < 4)).all()
