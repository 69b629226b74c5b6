"""The GPU backend: Pallas kernels (Triton) for the decode-time hot spots, behind `PallasOps`
(backend.py), which `ops.select` chooses on GPUs. Importing this package loads Pallas; nothing
outside it does.

While `PallasOps` traces an operation it declares its layout and settings here (`scope`): on a
tensor-parallel mesh the kernels run per device inside `shard_map` on each device's shards, and
tiles are chosen for the device kind. Every choice is logged once per shape on the `jaxllm.kernels`
logger and kept in `selections()`, so a run can say what it ran; a shape a kernel does not take
goes to XLA, logged the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from dataclasses import dataclass

import jax
from jax.experimental import pallas as pl

from jaxllm.ops.gpu import lowered, offsets

log = logging.getLogger("jaxllm.kernels")


@dataclass(frozen=True)
class Scope:
    layout: object = None  # the `model.sharding.Layout` traced for (None: one device)
    widen: str | None = None  # `RuntimeConfig.int8_widen`


_scope: contextvars.ContextVar = contextvars.ContextVar("gpu_scope", default=Scope())
_seen: dict[tuple, str] = {}


@contextlib.contextmanager
def scope(layout=None, widen: str | None = None):
    """Declare the layout (and settings) the kernels traced inside run under."""
    tok = _scope.set(Scope(layout, widen))
    try:
        yield
    finally:
        _scope.reset(tok)


def current_layout():
    """The declared layout, or None (then the computation is taken to be on one device)."""
    return _scope.get().layout


def widen_setting() -> str | None:
    return _scope.get().widen


def device_kind() -> str:
    """The kind of device what is traced now runs on (e.g. "NVIDIA H200"), for tiles tuned per GPU."""
    lay = current_layout()
    return (jax.devices()[0] if lay is None else lay.mesh.devices.flat[0]).device_kind


def interpret() -> bool:
    """Pallas runs compiled (Triton) on a GPU and interpreted anywhere else."""
    return jax.default_backend() != "gpu"


def install() -> None:
    """What the kernels need of JAX's Triton lowering (`offsets`, `lowered`), once a process."""
    offsets.install()
    lowered.install()


def _static(obj):
    """A hashable stand-in for a kernel's static parameters (kernels are `functools.partial`s of
    module functions over tiles, shapes and flags), typed so that 1 and 1.0 differ; TypeError
    where a parameter has no value identity (an array)."""
    if isinstance(obj, functools.partial):
        return (functools.partial, _static(obj.func), _static(obj.args), _static(obj.keywords))
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(_static(o) for o in obj))
    if isinstance(obj, dict):
        return (dict, tuple((k, _static(obj[k])) for k in sorted(obj)))
    hash(obj)
    return (type(obj), obj)


_calls: dict = {}


def pallas_call(kernel, **kw):
    """`pl.pallas_call`, compiled on a GPU and interpreted anywhere else; compiled, its operands
    are first checked against what the lowering's offsets can address (`offsets`).

    One jitted callable per kernel and parameters for the whole process: JAX traces a kernel
    again for every `pl.pallas_call`, and lowers it to Triton again at every use, so an unrolled
    36-layer decode step lowered each of its kernels 36 times. Through one jitted callable a
    kernel is traced once per shape, and lowered once per program (a function its layers call)."""
    try:
        key = (_static(kernel), _static(kw), interpret())
    except TypeError:  # parameters without value identity: no reuse
        key = None
    call = _calls.get(key) if key is not None else None
    if call is None:
        call = jax.jit(pl.pallas_call(kernel, interpret=interpret(), **kw))
        if key is not None:
            _calls[key] = call

    def run(*args):
        if not interpret():
            offsets.check(*args)
        return call(*args)

    return run


def note(kernel: str, shape: tuple, choice: str) -> None:
    key = (kernel, tuple(shape))
    if _seen.get(key) != choice:
        _seen[key] = choice
        log.info("%s %s -> %s", kernel, "x".join(map(str, shape)), choice)


def selections() -> list[dict]:
    """Every kernel choice made so far in this process: kernel, shape, and what ran it."""
    return [{"kernel": k, "shape": list(s), "choice": c} for (k, s), c in _seen.items()]
