"""The TPU path, proved by the TPU compiler without a TPU: the fused decode loop and a server's mixed
prefill chunk of real 30B-class shapes compile for a v6e:2x2 slice (TP=4, int8 weights) over the
paged KV pool, with the TPU backend's attention kernel in them, and fit a v6e chip's 32 GiB.

Needs libtpu (`pip install "jax[tpu]"`); the topology API works beside the CPU backend that the
rest of the suite uses."""
import jax
import pytest

from jaxllm.tools.tpu_compile import GiB, compile_shape, format_report


@pytest.mark.slow
def test_qwen3_32b_decode_loop_compiles_for_v6e_tp4():
    r = compile_shape("qwen3-32b", tp=4, max_ctx=2048, batch=1, topology="v6e:2x2", quant="int8",
                      programs=("decode_loop",))
    print("\n" + format_report(r))
    assert r["backend"] == "tpu" and r["decode_loop"]["kernel_calls"] >= 1
    bs = r["kv_pool"]["block_size"]
    assert r["kv_pool"]["tokens"] == 2048 and r["kv_pool"]["blocks"] == {"global": 2048 // bs + 1}
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
def test_gemma4_31b_decode_and_mixed_chunk_at_128k_fit_v6e():
    """Gemma 4 31B at 131072 positions: global layers in int8 blocks (the kernel's int8 path, one
    KV head a device), sliding layers in bfloat16 blocks that hold only the window and a chunk
    (four KV heads a device); the decode loop and a prefill forward of two pieces for any slots at
    any positions both run the kernel, and fit a v6e chip at TP=4."""
    r = compile_shape("gemma4-31b", tp=4, max_ctx=131072, batch=1, topology="v6e:2x2", quant="int8",
                      programs=("prefill_chunk", "decode_loop"), pieces=2, chunk=64)
    print("\n" + format_report(r))
    assert r["kv_cache"].startswith("int8 global KV")
    pool = r["kv_pool"]
    bs = pool["block_size"]             # sliding tables: the window and the chunk's 64 positions
    assert pool["tokens"] == 131072
    assert pool["table_widths"] == {"global": 131072 // bs, "sliding": -(-(1023 + 64) // bs) + 1}
    for name in ("prefill_chunk", "decode_loop"):
        m = r[name]["memory"]
        assert r[name]["kernel_calls"] >= 2, name                 # sliding and global layers
        assert m["argument"] + m["temp"] + m["output"] < 32 * GiB, name
    assert r["decode_loop"]["memory"]["temp"] < 2 * GiB
    # the int8 global blocks of 131072 positions are the bulk of the pool, split over the 4 chips
    assert r["cache_bytes_per_device"] < 4 * GiB
    assert r["weight_bytes_per_device"] < 0.3 * r["weight_bytes_total"]


@pytest.mark.slow
def test_qwen3_30b_a3b_decode_and_mixed_chunk_fit_v6e_tp4():
    """Qwen3-30B-A3B, int8: 128 experts a layer split 32 a chip, routed through the grouped matmul
    in a chunk and gathered per token in the decode loop. Both fit a v6e chip at TP=4; the decode
    loop's temporaries hold a relayout of the int8 expert stacks that XLA hoists out of the loop
    (9.4 GiB a chip; none at Gemma 4 26B-A4B's expert width of 704, where the layouts agree)."""
    # at the precision a server runs: the suite asks for "highest" (its float32 references), which
    # the TPU's grouped matmul kernel refuses for bfloat16 operands
    with jax.default_matmul_precision("default"):
        r = compile_shape("qwen3-30b-a3b", tp=4, max_ctx=4096, batch=1, topology="v6e:2x2", quant="int8",
                          programs=("prefill_chunk", "decode_loop"))
    print("\n" + format_report(r))
    assert r["backend"] == "tpu"
    for name in ("prefill_chunk", "decode_loop"):
        m = r[name]["memory"]
        assert r[name]["kernel_calls"] >= 1, name
        assert m["argument"] + m["temp"] + m["output"] < 32 * GiB, name
    assert r["prefill_chunk"]["memory"]["temp"] < 2 * GiB       # no widened copy of an expert stack
    assert r["weight_bytes_per_device"] < 0.3 * r["weight_bytes_total"]


def test_bad_requests_are_one_line():
    from jaxllm.errors import ModelError
    with pytest.raises(ModelError, match=r"^unknown shape 'qwen3-99b' \(known: .*qwen3-32b"):
        compile_shape("qwen3-99b")
    with pytest.raises(ModelError, match=r"^--tp 2 x --dp 1 must use all 4 chips of v6e:2x2$"):
        compile_shape("qwen3-32b", tp=2)
    with pytest.raises(ModelError, match=r"^--chunk must lie in \(0, 8192\)"):     # the model's default context
        compile_shape("qwen3-32b", chunk=8192)
