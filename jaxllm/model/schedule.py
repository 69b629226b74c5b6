"""Which path each layer takes through the layer scan: its branch (weight group, attention kind,
own KV cache or another layer's, routed experts or a dense MLP), its index in its group's weight
stack and the index of the KV cache it attends over in its kind's stack."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxllm.config.model import GLOBAL, SLIDING, ModelConfig
from jaxllm.errors import ModelError

MAX_PERIOD = 16


@dataclass(frozen=True)
class Branch:
    """One path through a layer: its weight stack (group), attention kind, whether it keeps a KV
    cache of its own or attends over another layer's, and whether it has routed experts."""

    group: str
    kind: int
    own_kv: bool = True
    routed: bool = False


def _branch_of(cfg: ModelConfig, layer: int) -> Branch:
    return Branch(cfg.group_of(layer), cfg.layer_kinds[layer], cfg.kv_source(layer) == layer, cfg.routed(layer))


def branches(cfg: ModelConfig) -> tuple[Branch, ...]:
    out: list[Branch] = []
    for i in range(cfg.num_layers):
        b = _branch_of(cfg, i)
        if b not in out:
            if any(o.group == b.group for o in out):
                raise ModelError(f"layer group {b.group!r} mixes attention kinds, KV sharing or routing")
            out.append(b)
    return tuple(out)


def schedule(cfg: ModelConfig) -> dict:
    """Per-layer scan inputs: the branch, the index in its group's weight stack, and the index of the
    KV cache it attends over in its kind's cache stack."""
    brs = branches(cfg)
    slot: dict[int, int] = {}
    n_cache = {SLIDING: 0, GLOBAL: 0}
    n_group: dict[str, int] = {}
    out = {"kind": [], "branch": [], "idx": [], "cache_idx": []}
    for i, k in enumerate(cfg.layer_kinds):
        b = _branch_of(cfg, i)
        if b.own_kv:
            slot[i] = n_cache[k]
            n_cache[k] += 1
        src = cfg.kv_source(i)
        if src not in slot or cfg.layer_kinds[src] != k:
            raise ModelError(
                f"layer {i} reads the KV cache of layer {src}, which is not an earlier layer of the same attention kind"
            )
        out["kind"].append(k)
        out["branch"].append(brs.index(b))
        out["idx"].append(n_group.get(b.group, 0))
        n_group[b.group] = out["idx"][-1] + 1
        out["cache_idx"].append(slot[src])
    return {k: np.asarray(v, np.int32) for k, v in out.items()}


def counted_layers(cfg: ModelConfig) -> bool:
    """Whether every layer takes the one branch at its own index in its weight and cache stacks."""
    s = schedule(cfg)
    n = np.arange(cfg.num_layers)
    return len(branches(cfg)) == 1 and (s["idx"] == n).all() and (s["cache_idx"] == n).all()


def layer_period(cfg: ModelConfig) -> int | None:
    """The shortest period of the layers' branch pattern (every layer on the branch of its place in
    the period, a last partial period included), or None above `MAX_PERIOD` layers."""
    b = schedule(cfg)["branch"]
    return next(
        (p for p in range(1, min(MAX_PERIOD, len(b)) + 1) if all(b[i] == b[i % p] for i in range(len(b)))), None
    )
