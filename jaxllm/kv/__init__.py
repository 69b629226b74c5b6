"""KV caches: the full-length cache, the split cache (sliding rings, blockwise global layers) and
the plan that picks one for a context length."""
