"""The runtime's choices, where jaxllm keeps things, and the one place the environment is read.

`RuntimeConfig` holds what picks code paths (the backend's kernels, the layer scan, its unrolling,
how kernels widen int8) and `Caches` where what a later process reuses is kept (the compilation
cache, the weight cache): frozen objects built once at the edge (command-line flags, `jaxllm.load`
arguments, or their `from_env()`) and passed down: `ops.select` gets the runtime, whose backend
object the model, the KV caches and the engine are given; the engine and the weight loader get the
caches. Nothing below the edge reads the environment.

`env(name)` reads one of the documented variables in `VARIABLES`; every front end that honours an
environment variable (the two objects here, the distributed runtime, the server's API key, the
bench's records) asks here, so the list below is the whole list.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jaxllm.errors import ModelError

VARIABLES = {
    "JAXLLM_KERNELS": "auto | xla | pallas: the Pallas kernels on GPUs and TPUs (auto), nowhere, or "
    "everywhere (the GPU's interpreted on a CPU)",
    "JAXLLM_LAYER_SCAN": "auto | cond | period: how the layer scan reaches sliding and global layers",
    "JAXLLM_SCAN_UNROLL": "layers per iteration of the layer scan: a count, or full (unset: chosen per step)",
    "JAXLLM_INT8_WIDEN": "convert | magic | bits: how GPU kernels widen int8 (unset: each kernel's own)",
    "JAXLLM_TRITON_GEMM": "on | off: XLA's autotuned Triton GEMMs on GPUs beside cuBLAS (default off)",
    "JAXLLM_WIDEN_ONCE": "auto | on | off: int8 weights widened once a GPU decode call for XLA's GEMMs (auto: "
    "above 256 rows where the copy fits)",
    "JAXLLM_CACHE": "the folder of jaxllm's per-user caches (default $XDG_CACHE_HOME/jaxllm)",
    "JAXLLM_WEIGHT_CACHE": "on | off: keep models built from GGUF files in the weight cache",
    "JAXLLM_COMPILATION_CACHE": "the compilation cache's folder, or off",
    "JAXLLM_DISTRIBUTED": "1: start JAX's distributed runtime from its environment variables",
    "JAXLLM_PROGRESS": "1: show loading progress bars even when stderr is not a terminal",
    "JAXLLM_DEBUG": "1: print tracebacks instead of one-line errors",
    "JAXLLM_COMMIT": "the commit a benchmark records, for a copy of the tree without .git",
    "JAXLLM_API_KEY": "the key the server requires (the --api-key default)",
    "XDG_CACHE_HOME": "the base of per-user cache folders",
    "XLA_FLAGS": "XLA's own flags (recorded by benchmarks, part of the compiled-steps key)",
    "JAX_DEFAULT_MATMUL_PRECISION": "JAX's matmul precision (part of the compiled-steps key)",
    "JAX_COORDINATOR_ADDRESS": "JAX's distributed runtime: the coordinator",
    "JAX_NUM_PROCESSES": "JAX's distributed runtime: the number of processes",
    "JAX_PROCESS_ID": "JAX's distributed runtime: this process's index",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "libtpu: let a process load it beside another (compiling for TPUs without one)",
}


def env(name: str, default: str | None = None) -> str | None:
    """The value of a documented environment variable (`VARIABLES`), or `default` where unset or empty."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a documented jaxllm environment variable")
    value = os.environ.get(name, "")
    return value if value.strip() else default


def set_default(name: str, value: str) -> None:
    """Set a documented variable for this process and its children, unless it is set already."""
    env(name)
    os.environ.setdefault(name, value)


def cache_home() -> Path:
    """`$XDG_CACHE_HOME`, else `~/.cache`."""
    base = env("XDG_CACHE_HOME")
    return Path(base).expanduser() if base else Path.home() / ".cache"


def cache_dir() -> Path:
    """jaxllm's per-user folder (the weight cache, the bench's results): `$JAXLLM_CACHE`, else
    `$XDG_CACHE_HOME/jaxllm`, else `~/.cache/jaxllm`."""
    own = env("JAXLLM_CACHE")
    return Path(own).expanduser() if own else cache_home() / "jaxllm"


# Environment that changes how XLA compiles (what picks the engine's code paths is its
# `RuntimeConfig`): part of each kept executable's key.
COMPILE_ENV = ("XLA_FLAGS", "JAX_DEFAULT_MATMUL_PRECISION")
OFF = ("off", "none", "0", "false", "no")


@dataclasses.dataclass(frozen=True)
class Caches:
    """Where jaxllm keeps what a later process reuses; the default keeps nothing (what a front end
    keeps is `Caches.from_env`).

    folder: jaxllm's per-user folder (the weight cache and the digests of GGUF files); None: none.
    compilation: the compilation cache's folder (JAX's persistent cache and the engine's own
      executables, see `engine.compilation_cache`); None: off.
    weights: keep models built from GGUF files under `folder` (see `weights.weight_cache`).
    compile_env: (name, value) of the environment that changes how XLA compiles, part of each kept
      executable's key.
    """

    folder: Path | None = None
    compilation: Path | None = None
    weights: bool = False
    compile_env: tuple = ()

    @classmethod
    def from_env(cls, compilation_cache: str | None = None, weight_cache: bool | None = None) -> "Caches":
        """The caches of a front end: `folder` from $JAXLLM_CACHE, else $XDG_CACHE_HOME/jaxllm, else
        ~/.cache/jaxllm; `compilation` the folder `compilation_cache` names ("off": none; None:
        $JAXLLM_COMPILATION_CACHE, else $XDG_CACHE_HOME/jaxllm/xla); `weights` from `weight_cache`
        (None: $JAXLLM_WEIGHT_CACHE, on unless "off"). A bad value is a one-line error naming it."""
        value = compilation_cache if compilation_cache is not None else env("JAXLLM_COMPILATION_CACHE")
        if value is not None and str(value).strip().lower() in OFF:
            compilation = None
        else:
            compilation = Path(value).expanduser() if value else cache_home() / "jaxllm" / "xla"
        if weight_cache is None:
            raw = env("JAXLLM_WEIGHT_CACHE", "")
            word = raw.strip().lower()
            if word and word not in SWITCH:
                raise ModelError(f"JAXLLM_WEIGHT_CACHE must be 'on' or 'off', got {raw!r}")
            weight_cache = SWITCH.get(word, True)
        return cls(
            folder=cache_dir(),
            compilation=compilation,
            weights=bool(weight_cache),
            compile_env=tuple((k, env(k, "")) for k in COMPILE_ENV),
        )


KERNELS = ("auto", "xla", "pallas")
LAYER_SCANS = ("auto", "cond", "period")
WIDENINGS = ("convert", "magic", "bits")
WIDEN_ONCE = ("auto", "on", "off")
SWITCH = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False}


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """What picks the code a model runs, as opposed to what the model is (`ModelConfig`).

    kernels: `auto` uses the Pallas kernels on GPUs (one, or a tensor-parallel mesh) and TPUs
      and XLA elsewhere; `xla` the pure-XLA reference everywhere; `pallas` the kernels everywhere,
      the GPU's interpreted on a CPU (how the tests check them).
    layer_scan: how the layer scan reaches a layer's sliding or global branch: `cond` (a
      `lax.cond` per layer) or `period` (a scan over whole periods of the pattern); `auto` takes
      periods (see `XlaOps.layer_scan`).
    scan_unroll: layers per scan iteration, a count or "full"; None lets the backend choose per step.
    int8_widen: how GPU kernels widen int8 values (see `ops.gpu.widen`); None: each kernel's default.
    triton_gemm: on GPUs, let XLA try its Triton GEMMs beside cuBLAS for each matmul it compiles
      (autotuned at compile time); off, XLA's GEMMs are cuBLAS's (see `XlaOps.compiler_options`).
    widen_once: on GPUs, where a decode step's matmuls are XLA's GEMMs (more rows than the kernels
      take), widen the int8 weights to the compute dtype once a decode call rather than in every
      step: `auto` where the widened copy fits the device's memory beside the call's own, `on`
      always, `off` never (see `PallasOps.loop_weights`).
    """

    kernels: str = "auto"
    layer_scan: str = "auto"
    scan_unroll: int | str | None = None
    int8_widen: str | None = None
    triton_gemm: bool = False
    widen_once: str = "auto"

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise ModelError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.layer_scan not in LAYER_SCANS:
            raise ModelError(f"layer_scan must be one of {', '.join(LAYER_SCANS)}, got {self.layer_scan!r}")
        u = self.scan_unroll
        if u is not None and u != "full" and not (isinstance(u, int) and u >= 1):
            raise ModelError(f"scan_unroll must be a positive number of layers or 'full', got {u!r}")
        if self.int8_widen is not None and self.int8_widen not in WIDENINGS:
            raise ModelError(f"int8_widen must be one of {', '.join(WIDENINGS)}, got {self.int8_widen!r}")
        if not isinstance(self.triton_gemm, bool):
            raise ModelError(f"triton_gemm must be on or off, got {self.triton_gemm!r}")
        if self.widen_once not in WIDEN_ONCE:
            raise ModelError(f"widen_once must be one of {', '.join(WIDEN_ONCE)}, got {self.widen_once!r}")

    @classmethod
    def from_env(cls, **overrides) -> "RuntimeConfig":
        """The configuration the environment variables name (JAXLLM_KERNELS, JAXLLM_LAYER_SCAN,
        JAXLLM_SCAN_UNROLL, JAXLLM_INT8_WIDEN, JAXLLM_TRITON_GEMM, JAXLLM_WIDEN_ONCE), with
        `overrides` on top; a bad value is a one-line error naming the variable."""

        def word(name, default=None):
            v = env(name)
            return default if v is None else v.strip().lower()

        raw = {
            "kernels": ("JAXLLM_KERNELS", word("JAXLLM_KERNELS", "auto")),
            "layer_scan": ("JAXLLM_LAYER_SCAN", word("JAXLLM_LAYER_SCAN", "auto")),
            "int8_widen": ("JAXLLM_INT8_WIDEN", word("JAXLLM_INT8_WIDEN")),
            "scan_unroll": ("JAXLLM_SCAN_UNROLL", word("JAXLLM_SCAN_UNROLL")),
            "triton_gemm": ("JAXLLM_TRITON_GEMM", word("JAXLLM_TRITON_GEMM", "off")),
            "widen_once": ("JAXLLM_WIDEN_ONCE", word("JAXLLM_WIDEN_ONCE", "auto")),
        }
        values = {k: v for k, (_, v) in raw.items()}
        values["triton_gemm"] = SWITCH.get(values["triton_gemm"], values["triton_gemm"])
        u = values["scan_unroll"]
        if u is not None and u.isdigit():
            values["scan_unroll"] = int(u)
        for field, (var, _) in raw.items():
            if field in overrides:
                continue
            try:
                cls(**{field: values[field]})
            except ModelError as e:
                raise ModelError(f"{var}: {e}") from None
        return cls(**{**values, **overrides})
