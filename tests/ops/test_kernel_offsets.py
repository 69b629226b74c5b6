"""The Triton lowering's offsets reach every element of a 2-4 GiB int8 operand (`kernels.offsets`).

Lowered for CUDA from the CPU with abstract operands, so no memory is allocated: the offsets the
lowering builds for each ref are recorded, and their integer width checked."""
import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as tl

from jaxllm.errors import ModelError
from jaxllm.ops.gpu import matmul, offsets


def _offset_widths(monkeypatch, lower, w_shape):
    """{bit width of the offsets built for refs of each shape} while lowering a batch-1 product
    that reads the last layer of an int8 stack of w_shape [L, N, K]."""
    seen = {}
    installed = tl._compute_offsets_from_indices

    def record(block_info, nd_indexer):
        out = installed(block_info, nd_indexer)
        t = out.type
        el = ir.RankedTensorType(t).element_type if isinstance(t, ir.RankedTensorType) else t
        seen.setdefault(tuple(block_info.full_shape_dtype.shape), set()).add(ir.IntegerType(el).width)
        return out
    monkeypatch.setattr(tl, "_compute_offsets_from_indices", record)
    L, N, K = w_shape
    args = (jax.ShapeDtypeStruct((1, K), jnp.bfloat16), jax.ShapeDtypeStruct(w_shape, jnp.int8),
            jax.ShapeDtypeStruct((L, N), jnp.float32))
    lower(lambda x, w, s: matmul.stacked_matmul(x, w, s, L - 1, out_major=True), *args)
    return seen


def test_installed():
    assert offsets.install()


@pytest.mark.parametrize("w_shape, width", [((5, 8192, 65536), 64),     # 2.5 GiB: past 2**31 elements
                                            ((3, 8192, 65536), 32),     # 1.5 GiB
                                            ((9, 8192, 65536), 64)])    # 4.5 GiB: the lowering's own bound
def test_int8_stack_offsets(monkeypatch, lower_for_cuda, w_shape, width):
    seen = _offset_widths(monkeypatch, lower_for_cuda, w_shape)
    assert seen[w_shape] == {width}
    assert seen[(1, w_shape[2])] == {32}          # the bf16 input row keeps 32-bit offsets


def test_refused_without_the_fix(monkeypatch):
    monkeypatch.setattr(offsets, "_installed", False)
    with pytest.raises(ModelError, match=r"int8 array of shape \(5, 8192, 65536\).*JAXLLM_KERNELS=xla"):
        offsets.check(jax.ShapeDtypeStruct((5, 8192, 65536), jnp.int8))
    offsets.check(jax.ShapeDtypeStruct((3, 8192, 65536), jnp.int8),
                  jax.ShapeDtypeStruct((5, 8192, 65536), jnp.bfloat16), None)
