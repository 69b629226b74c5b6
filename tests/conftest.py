import os
import sys

# The ordinary suite runs on the CPU even where libtpu is installed (the TPU compile checks
# build their own topology); set before anything imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))
