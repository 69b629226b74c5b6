"""The engine core (slots, one KV cache, chunked prefill, decode blocks), sampling, speculative
decoding, the sharding of weights and caches, and `Engine`, which offline generation and the server
drive."""
from jaxllm.engine.engine import Completion, Engine

__all__ = ["Completion", "Engine"]
