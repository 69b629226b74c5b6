"""The engine core (slots, one KV cache, chunked prefill, decode blocks), sampling, speculative
decoding, the sharding of weights and caches, and `engine.Engine`, which offline generation and the
server drive. Importing the package loads none of them (nor JAX): `compilation_cache` and the
request checks serve front ends before JAX loads."""
