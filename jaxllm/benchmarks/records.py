"""What every benchmark shares: its comma-separated lists, the points a sweep takes on each platform,
where its results go and the commit they record, its progress lines."""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

from jaxllm.config.runtime import cache_dir, env

# The points a sweep measures where --batches, --ctx and --steps are not given, per platform. GPUs
# and TPUs: those of the recorded results. A CPU: two small points (the gemma3-270m shape: 48 s on a
# shared 2-core machine, where the GPUs' points took 687 s).
SWEEPS = {"cpu": {"batches": [1, 8], "ctx": 256, "steps": 16}}
ACCELERATOR_SWEEP = {"batches": [1, 8, 64], "ctx": 1024, "steps": 64}


def int_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"values must be positive, got {s!r}")
    return out


def size_for(a, platform: str) -> None:
    """The sweep's points left unset take the platform's (`SWEEPS`)."""
    for name, value in SWEEPS.get(platform, ACCELERATOR_SWEEP).items():
        if getattr(a, name) is None:
            setattr(a, name, value)


def subject_name(a) -> str:
    """The model's name in file names: the shape, the model directory's name, a served URL's host."""
    if getattr(a, "shape", None):
        return Path(a.shape).stem
    if getattr(a, "model_dir", None):
        return Path(a.model_dir).name
    url = getattr(a, "url", None)
    return url.split("//")[-1].split("/")[0].replace(":", "-") if url else "embedded"


def default_out(a, prefix: str = "") -> Path:
    """A new file under the user's cache (`config.runtime.cache_dir`), named for the model and the time."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return cache_dir() / "bench" / f"{prefix}{subject_name(a)}-{stamp}.json"


def note(line: str) -> None:
    """A progress line on stderr."""
    print(f"bench: {line}", file=sys.stderr, flush=True)


def git_commit() -> str:
    if env("JAXLLM_COMMIT"):  # a copy of the tree without its .git
        return env("JAXLLM_COMMIT")
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
