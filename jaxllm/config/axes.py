"""Logical axis names of the KV cache's arrays, the one table: every leaf of every layout ([layers,
batch rows, slots, KV heads, head_dim] values, their [.., KV heads] int8 scales, a ring's [.., slots]
positions) is named by the leading entries of `CACHE_AXES`. `engine.sharding.RULES` maps the names
to mesh axes (KV heads over "model", rows over "data")."""
CACHE_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")


def cache_leaf_axes(ndim: int) -> tuple:
    return CACHE_AXES[:ndim]
