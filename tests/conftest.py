import os
import sys

# The ordinary suite runs on the CPU even where libtpu is installed (the TPU compile checks
# build their own topology); set before anything imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Float32 references at full precision on every backend: on a GPU, XLA's default float32 dot uses
# TF32 (errors near 1e-3), which the kernel tests' tolerances would otherwise measure when they run
# compiled there. CPUs compute float32 dots in full either way.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# The front ends turn JAX's persistent compilation cache on; the suite's processes (both workers,
# the servers and CLIs they start) share one folder of their own, so each step compiles once a run.
os.environ.setdefault("JAXLLM_COMPILATION_CACHE", os.path.join(__import__("tempfile").gettempdir(),
                                                               f"jaxllm-test-xla-{os.getuid()}"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))       # the shared test helpers
# Compile fast (tests/helpers/xla_env.py): the processes the suite starts inherit the flags, except
# those that decode the real model for long, which take `xla_env.full_speed()`.
import xla_env  # noqa: E402

os.environ["XLA_FLAGS"] = xla_env.with_fast_compile(os.environ.get("XLA_FLAGS", ""))

import pytest  # noqa: E402


@pytest.fixture
def lower_for_cuda(monkeypatch):
    """lower(f, *abstract_args): f's kernels lowered for an H100 (Pallas to Triton) from this
    machine, without a GPU and without allocating anything; returns the lowered program."""
    import types

    import jax
    from jax._src.pallas.triton import pallas_call_registration as reg

    import jaxllm.ops.gpu as kernels
    kernels.install()             # what the GPU backend (`PallasOps`) puts in JAX's Triton lowering
    monkeypatch.setattr(kernels, "interpret", lambda: False)
    info = getattr(reg, "gpu_info_lib", None)       # newer JAX asks the GPU for its compute capability
    if info is not None:
        try:
            info.get_gpu_info()
        except ValueError:                          # none here: lower for an H100's
            monkeypatch.setattr(info, "get_gpu_info", lambda *a, **k: types.SimpleNamespace(compute_capability=90))

    def lower(f, *args):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return lower
