"""The TPU path, proved by the TPU compiler without a TPU: the fused decode loop of real 30B-class
shapes compiles for a v6e:2x2 slice (TP=4, int8 weights) and fits a v6e chip's 32 GiB.

Needs libtpu (`pip install "jax[tpu]"`); the topology API works beside the CPU backend that the
rest of the suite uses."""
import pytest

from jaxllm.harness.tpu_compile import GiB, compile_shape, format_report
from jaxllm.model.families import FAMILIES

SHAPES = ["qwen3-32b"]
if any("gemma4" in t for f in FAMILIES for t in f.MODEL_TYPES):
    SHAPES.append("gemma4-31b")


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_loop_compiles_for_v6e_tp4(shape):
    r = compile_shape(shape, tp=4, max_ctx=2048, batch=1, topology="v6e:2x2", quant="int8",
                      programs=("decode_loop",))
    print("\n" + format_report(r))
    m = r["decode_loop"]["memory"]
    assert m["argument"] + m["temp"] + m["output"] < 32 * GiB
    # the weights are split four ways, not replicated: a device holds about a quarter of them
    assert r["weight_bytes_per_device"] < 0.3 * r["weight_bytes_total"]
    assert m["argument"] < 1.1 * (r["weight_bytes_per_device"] + r["cache_bytes_per_device"]) + 2**20
    # int8 weights are dequantized inside the matmul fusions: no bf16 copy of a weight stack
    # (one would be several GiB) ever exists as a temporary
    assert m["temp"] < 2 * GiB
    assert 1e9 < r["bytes_per_step"] < 12e9
    assert 1.0 < r["predicted_step_ms"] < 8.0


@pytest.mark.slow
def test_gemma4_31b_at_128k_fits_v6e_with_the_split_cache():
    """Above 32K the engine keeps sliding layers in window-sized rings and global layers in int8:
    Gemma 4 31B at 131072 positions, batch 1, TP=4 still fits a v6e chip's 32 GiB."""
    r = compile_shape("gemma4-31b", tp=4, max_ctx=131072, batch=1, topology="v6e:2x2", quant="int8",
                      programs=("decode_loop",))
    print("\n" + format_report(r))
    assert r["kv_cache"] == "split"
    m = r["decode_loop"]["memory"]
    assert m["argument"] + m["temp"] + m["output"] < 32 * GiB
    # the int8 global cache of 131072 positions is the bulk of the cache, split over the 4 chips
    assert r["cache_bytes_per_device"] < 4 * GiB


def test_bad_requests_are_one_line():
    from jaxllm.errors import ModelError
    with pytest.raises(ModelError, match=r"^unknown shape 'qwen3-99b' \(known: .*qwen3-32b"):
        compile_shape("qwen3-99b")
    with pytest.raises(ModelError, match=r"^--tp 2 x --dp 1 must use all 4 chips of v6e:2x2$"):
        compile_shape("qwen3-32b", tp=2)
