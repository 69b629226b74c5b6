"""Each kernel lowered to Triton once a process.

Pallas lowers a kernel's jaxpr to a Triton module (in an MLIR context of its own) every time a
program holding it is lowered, so the server's decode blocks with and without log-probabilities,
which hold the same kernels, lowered them twice; lowering the kernels was a quarter of the time a
cold server spent tracing and lowering its calls. With `ops.gpu.pallas_call` reusing one traced
jaxpr per kernel and shape, the module lowered for that jaxpr is kept and handed out again.

`install()` wraps JAX's `lower_jaxpr_to_triton_module`; where this JAX has no such function it
installs nothing and returns False (every lowering then runs as before).
"""

from __future__ import annotations

import threading

_installed: bool | None = None
_lock = threading.Lock()
_modules: dict = {}
_original = None  # JAX's own lowering


def install() -> bool:
    global _installed, _original
    if _installed is not None:
        return _installed
    try:
        from jax._src.pallas.triton import lowering as tl

        orig = tl.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError):
        _installed = False
        return False
    if getattr(orig, "_jaxllm_kept", False):
        _installed = True
        return True

    def lower(jaxpr, grid_mapping, platform, compute_capability, *args, **kw):
        # The jaxpr and grid mapping are the pallas_call's own objects (compared by identity) and
        # stay referenced by the key, so an id is never reused for another kernel.
        key = (id(jaxpr), id(grid_mapping), platform, compute_capability)
        with _lock:
            hit = _modules.get(key)
        if hit is not None:
            return hit[2]
        result = _original(jaxpr, grid_mapping, platform, compute_capability, *args, **kw)
        with _lock:
            _modules[key] = (jaxpr, grid_mapping, result)
        return result

    lower._jaxllm_kept = True
    _original = orig
    tl.lower_jaxpr_to_triton_module = lower
    _installed = True
    return True
