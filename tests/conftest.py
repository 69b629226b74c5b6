import os
import sys

# The ordinary suite runs on the CPU even where libtpu is installed (the TPU compile checks
# build their own topology); set before anything imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Float32 references at full precision on every backend: on a GPU, XLA's default float32 dot uses
# TF32 (errors near 1e-3), which the kernel tests' tolerances would otherwise measure when they run
# compiled there. CPUs compute float32 dots in full either way.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# `jaxllm.load` turns the persistent compilation cache on; the suite's processes (both workers, the
# servers and CLIs they start) share one folder of their own, so each step compiles once a run.
os.environ.setdefault("JAXLLM_COMPILATION_CACHE", os.path.join(__import__("tempfile").gettempdir(),
                                                               f"jaxllm-test-xla-{os.getuid()}"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))       # the shared test helpers
# Compile fast (tests/helpers/xla_env.py): the processes the suite starts inherit the flags, except
# those that decode the real model for long, which take `xla_env.full_speed()`.
import xla_env  # noqa: E402

os.environ["XLA_FLAGS"] = xla_env.with_fast_compile(os.environ.get("XLA_FLAGS", ""))
# The engines the tests make in their own process keep no executables in it (JAX's cache, keyed by
# the program itself, they use): tests patch the functions a step traces, and read what tracing
# records (the kernels chosen), which a step read back whole would skip.
import jaxllm.engine.compilation_cache  # noqa: E402

jaxllm.engine.compilation_cache.KEEP_STEPS = False

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


# The files that take minutes on the 2-core machine CI runs on (their tests' times summed, as the
# suite's durations report gives them), longest first. `pytest -n 2 --dist loadfile` hands each
# worker a whole file at a time, in collection order (pyproject.toml turns off xdist's reordering
# by test count, which sent the long files with few tests last, where one worker ran them alone
# while the other had finished).
LONG_FILES = [
    "serve/test_server.py", "ops/test_kernels.py", "engine/test_speculative.py", "harness/test_real_model.py",
    "kv/test_long_context.py", "serve/test_scheduler.py", "engine/test_decode.py", "serve/test_lm_eval.py",
    "harness/test_perplexity.py", "serve/test_structured.py", "harness/test_bench.py", "model/test_int8_quality.py",
    "engine/test_sharding.py", "weights/test_gguf.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {f: i for i, f in enumerate(LONG_FILES)}
    here = os.path.dirname(os.path.abspath(__file__))

    def key(item):
        path = os.path.relpath(str(item.path), here).replace(os.sep, "/")
        return rank.get(path, len(LONG_FILES))
    items.sort(key=key)                  # stable: the other files, and each file's tests, keep their order
