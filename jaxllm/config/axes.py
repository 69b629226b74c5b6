"""Logical axis names of the KV pools' arrays, the one table: every leaf of every pool ([layers,
blocks, positions in a block, KV heads, head_dim] values, their [.., KV heads] int8 scales) is named
by the leading entries of `CACHE_AXES`. `model.sharding.RULES` maps the names to mesh axes (KV heads
over "model"; any row may use any block, so blocks are not split)."""

CACHE_AXES = ("layers", "blocks", "cache_seq", "kv_heads", "head_dim")


def cache_leaf_axes(ndim: int) -> tuple:
    return CACHE_AXES[:ndim]
