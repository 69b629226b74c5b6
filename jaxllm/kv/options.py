"""The storage format of each attention kind (`KVLayout`), chosen from `--kv-quant`, the context
length and the tunables (`config.kv.KVOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.config.kv import KV_QUANT_MODES, KVOptions
from jaxllm.errors import ModelError


@dataclass(frozen=True)
class KVLayout:
    """How each attention kind stores its keys and values: global layers in the compute dtype or
    int8 (a float32 scale per token and head), sliding layers likewise (int8 only with int8 global
    layers and `KVOptions.int8_rings`). Sliding layers hold only their window in every layout."""

    int8: bool  # global layers
    int8_sliding: bool = False

    @property
    def name(self) -> str:
        if not self.int8:
            return "compute-dtype KV"
        return "int8 KV" if self.int8_sliding else "int8 global KV (sliding layers in the compute dtype)"


def choose_layout(kv_quant: str, max_ctx: int, opts: KVOptions) -> KVLayout:
    if kv_quant not in KV_QUANT_MODES:
        raise ModelError(f"kv_quant must be one of {', '.join(KV_QUANT_MODES)}, got {kv_quant!r}")
    int8 = kv_quant == "int8" or (kv_quant == "auto" and max_ctx > opts.threshold)
    return KVLayout(int8=int8, int8_sliding=int8 and opts.int8_rings)
