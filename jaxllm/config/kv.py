"""The KV memory's tunables (`KVOptions`) and the formats `--kv-quant` names: configuration, which
the engine's configuration holds and the KV memory (`kv`) reads."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.errors import ModelError

KV_QUANT_MODES = ("auto", "int8", "none")


@dataclass(frozen=True)
class KVOptions:
    """Tunables of the KV memory.

    `block_size`: positions a KV block holds (vLLM's `--block-size`): the unit of allocation and of
    prefix reuse. `threshold`: the longest max_ctx whose global layers keep the compute dtype under
    kv_quant="auto" (int8 above). `read_block`: positions a step of the XLA attention reads (a
    multiple of `block_size`). `prefill_chunk`: tokens a forward takes of a long prompt.
    `int8_rings`: with int8 global layers, the sliding layers' blocks in int8 as well (half their
    memory, for very large batches). `store_keys`: global layers whose V is their K (Gemma 4's
    k_eq_v) store their keys as well as their values; with False they store V alone, half those
    layers' memory, and attention rebuilds every key from it at every step (RMS norm and RoPE): on
    one H200 that attention measured 4x slower at batch 64 and above, and Gemma 4 31B decoded 1506
    tok/s against 1798 at batch 64 (as fast at batch 1). `spec_tokens`: tokens a speculative cycle
    may write past a row's position."""

    threshold: int = 32768
    block_size: int = 64
    read_block: int = 1024
    prefill_chunk: int = 4096
    int8_rings: bool = False
    store_keys: bool = True
    spec_tokens: int = 0

    def __post_init__(self):
        for name in ("threshold", "block_size", "read_block", "prefill_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelError(f"KV option {name} must be a positive integer, got {v!r}")
        if self.block_size & (self.block_size - 1) or self.block_size < 8:
            raise ModelError(f"KV option block_size must be a power of two of at least 8, got {self.block_size}")
        if not isinstance(self.spec_tokens, int) or self.spec_tokens < 0:
            raise ModelError(f"KV option spec_tokens must be a non-negative integer, got {self.spec_tokens!r}")
        for name in ("int8_rings", "store_keys"):
            if not isinstance(getattr(self, name), bool):
                raise ModelError(f"KV option {name} must be True or False, got {getattr(self, name)!r}")

    @property
    def read(self) -> int:
        """`read_block` rounded up to whole KV blocks."""
        return -(-self.read_block // self.block_size) * self.block_size
