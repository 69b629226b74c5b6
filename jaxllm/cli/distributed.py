"""Multi-host runs through JAX's own runtime: every process runs the same command, loads only the
shards of its own devices, and process 0 prints.

Launch: the same command on every host with `--coordinator-address HOST:PORT --num-processes N
--process-id I`, or with JAX's environment variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID), or on a Cloud TPU pod slice with no flags at all (JAX finds its peers itself when
JAXLLM_DISTRIBUTED=1 is set).
"""

from __future__ import annotations

import argparse

from jaxllm.config.runtime import env
from jaxllm.errors import ModelError

ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-host")
    g.add_argument(
        "--coordinator-address",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordinator (jax.distributed)",
    )
    g.add_argument("--num-processes", type=int, default=None, help="number of processes in the run")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0-based")


def _flags(args) -> tuple:
    return (
        getattr(args, "coordinator_address", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
    )


def check_args(args) -> None:
    """The multi-host flags' own consistency (no JAX: front ends check it before JAX loads)."""
    check(*_flags(args))


def init_from_args(args) -> bool:
    """Start the distributed runtime when the flags or the environment ask for it.

    Returns True when this is a multi-process run. Must run before anything touches a device."""
    return initialize(*_flags(args))


def check(coordinator_address=None, num_processes=None, process_id=None) -> None:
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
        raise ModelError("--coordinator-address, --num-processes and --process-id go together")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ModelError(f"--process-id {process_id} is not in [0, {num_processes})")


def initialize(coordinator_address=None, num_processes=None, process_id=None) -> bool:
    check(coordinator_address, num_processes, process_id)
    from_env = any(env(v) for v in ENV_VARS) or env("JAXLLM_DISTRIBUTED") == "1"
    if coordinator_address is None and not from_env:
        return False
    import jax

    # Only the CPU client reads this: CPU processes exchange collectives through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
        )
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot join the distributed run: {first}") from None
    return jax.process_count() > 1


def is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


def main_print(*a, **kw) -> None:
    """print() on process 0 only, so a multi-host run writes its output once."""
    if is_main_process():
        print(*a, **kw)
