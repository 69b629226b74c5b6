import os
import sys

# The ordinary suite runs on the CPU even where libtpu is installed (the TPU compile checks
# build their own topology); set before anything imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Float32 references at full precision on every backend: on a GPU, XLA's default float32 dot uses
# TF32 (errors near 1e-3), which the kernel tests' tolerances would otherwise measure when they run
# compiled there. CPUs compute float32 dots in full either way.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
sys.path.insert(0, os.path.dirname(__file__))
