"""Frozen dataclasses that are JAX pytrees: the engine's state, caches and weight wrappers.

`@pytree.dataclass` makes a frozen dataclass whose fields are the pytree's children, except those
declared with `static(...)`, which are part of its structure (compiled in, compared on a cache
hit). `.replace(**changes)` returns a copy. This is what `flax.struct` offers, from JAX itself, so
that importing the engine does not import flax.
"""

from __future__ import annotations

import dataclasses

import jax


def static(default=dataclasses.MISSING):
    """A field that is part of the pytree's structure, not a child."""
    return dataclasses.field(default=default, metadata={"static": True})


def _replace(self, **changes):
    return dataclasses.replace(self, **changes)


def dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.replace = _replace
    return jax.tree_util.register_dataclass(cls)
