"""The CPU backend's output head over int8 weights, piece by piece, against XLA's reference."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import ops
from jaxllm.config.runtime import RuntimeConfig
from jaxllm.ops.cpu import HEAD_PIECE, CpuOps
from jaxllm.ops.xla import XlaOps
from jaxllm.quant import QuantArray, quantize_np, quantize_rows_np


def test_head_in_pieces_equals_the_reference():
    rng = np.random.default_rng(0)
    V, D = 2 * HEAD_PIECE, 16
    h = jnp.asarray(rng.standard_normal((3, 2, D)), jnp.float32)
    cpu, ref = CpuOps(), XlaOps()
    tied = QuantArray(*map(jnp.asarray, quantize_rows_np(rng.standard_normal((V, D)))))
    untied = QuantArray(*map(jnp.asarray, quantize_np(rng.standard_normal((D, V)))))
    for table, is_tied in ((tied, True), (untied, False)):
        got = jax.jit(lambda h, t, tied=is_tied: cpu.output_head(h, t, tied))(h, table)
        want = ref.output_head(h, table, is_tied)
        assert got.shape == (3, 2, V) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    odd = QuantArray(*map(jnp.asarray, quantize_rows_np(rng.standard_normal((V + 8, D)))))   # not whole pieces
    np.testing.assert_allclose(cpu.output_head(h, odd, True), ref.output_head(h, odd, True), rtol=1e-6)


def test_the_cpu_backend_is_chosen_once_at_the_edge():
    assert type(ops.select(RuntimeConfig(kernels="auto"))) is CpuOps
    assert type(ops.select(RuntimeConfig(kernels="xla"))) is XlaOps       # the reference stays the reference
