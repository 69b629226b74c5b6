"""The suite's XLA flags. The tiny models' tests compile far more than they run, so the suite's
processes compile without LLVM's optimizations and with XLA's older CPU fusion code generation
(about two thirds of the compile time). A process that decodes the real embedded model for long
(a server, the CLI) runs with XLA's defaults instead: there the same flags make each decode step
2 to 4 times slower."""
from __future__ import annotations

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def with_fast_compile(flags: str) -> str:
    """XLA_FLAGS with the suite's flags added, unless the flags already set an optimization level."""
    if "xla_backend_optimization_level" in flags:
        return flags
    return " ".join([flags, *FAST_COMPILE]).strip()


def full_speed(env: dict | None = None) -> dict:
    """A child process's environment (default: this one's) without the suite's flags."""
    env = dict(os.environ if env is None else env)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE)
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env
