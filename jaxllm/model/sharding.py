"""How arrays lie on devices: a mesh ("data", "model") and one table of logical-axis rules.

Every weight and cache axis carries a logical name (params.ParamSpec.axes, config.axes.CACHE_AXES); RULES maps
names to mesh axes, so the whole tensor-parallel strategy is the table below. Rules are applied per
array from its actual shape: an axis the mesh does not divide is replicated (KV heads fewer than the
TP degree, an odd vocabulary), except the axes in MUST_SPLIT, whose replication would silently
multiply the work of every device, so a TP degree that cannot divide them is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config.axes import cache_leaf_axes
from jaxllm.errors import ModelError
from jaxllm.model.params import ParamSpec, is_spec, map_specs
from jaxllm.quant import QuantArray, fp8_ratios

RULES: dict[str, str | None] = {
    "batch": "data",
    "q_heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "expert": "model",
    "moe_mlp": "model",  # used only when the experts themselves cannot be split
    "embed": None,
    "head_dim": None,
    "layers": None,
    "blocks": None,
    "seq": None,
    "cache_seq": None,
}
MUST_SPLIT = {"q_heads": "query heads", "mlp": "MLP width", "expert": "experts"}


def make_mesh(tp: int | None = None, dp: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over `devices` (default: every device of every process).

    tp=None is every local device (a process's devices share the fast interconnect). In a
    multi-process run every device must be in the mesh, so the data axis grows to cover them."""
    grow = devices is None and jax.process_count() > 1
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if dp < 1 or n % dp:
        raise ModelError(f"--dp {dp} does not divide the {n} available devices")
    tp = min(jax.local_device_count(), n // dp) if tp is None else int(tp)
    if tp < 1 or tp * dp > n:
        raise ModelError(f"--tp {tp} x dp {dp} needs {tp * dp} devices, but {n} are available")
    if grow and n % tp == 0:
        dp = n // tp
    arr = np.asarray(devices[: tp * dp], dtype=object).reshape(dp, tp)
    return Mesh(arr, ("data", "model"))


@dataclass(frozen=True)
class Layout:
    """A mesh plus the rules: turns logical axes into NamedShardings and moves host data on/off."""

    mesh: Mesh
    rules: tuple[tuple[str, str | None], ...] = tuple(RULES.items())

    @property
    def platform(self) -> str:
        """ "cpu", "gpu" or "tpu": the devices' (one kind to a mesh)."""
        return self.mesh.devices.flat[0].platform

    @property
    def tp(self) -> int:
        return self.mesh.shape["model"]

    @property
    def dp(self) -> int:
        return self.mesh.shape["data"]

    def spec(self, shape, axes) -> P:
        rules = dict(self.rules)
        parts, used = [], set()
        for dim, name in zip(shape, axes):
            mesh_axis = rules.get(name) if name else None
            size = self.mesh.shape[mesh_axis] if mesh_axis else 1
            if mesh_axis is None or size == 1 or mesh_axis in used:
                parts.append(None)
            elif dim % size:
                if name in MUST_SPLIT:
                    flag = "--tp" if mesh_axis == "model" else "--dp"
                    raise ModelError(f"{flag} {size} does not divide {dim} {MUST_SPLIT[name]}")
                parts.append(None)
            else:
                parts.append(mesh_axis)
                used.add(mesh_axis)
        return P(*parts)

    def sharding(self, shape, axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(shape, axes))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # -- weights --------------------------------------------------------------------------------
    def param_sharding(self, spec: ParamSpec, quantized: bool | str):
        """NamedSharding of a weight, or a QuantArray of shardings (values, scales). `quantized`:
        the weight's format on the device (`weights.weight_format`: "int8", "fp8" for block scales,
        None or False for the compute dtype; True is "int8")."""
        q = self.sharding(spec.shape, spec.axes)
        if not quantized:
            return q
        blockwise = quantized == "fp8"
        return QuantArray(q, self.sharding(*scale_shape_axes(spec, blockwise)), spec.n_contract, blockwise)

    def weight_shardings(self, tree: dict, quantized) -> dict:
        """`quantized(spec)` says each weight's format (`param_sharding`)."""
        return map_specs(lambda s: self.param_sharding(s, quantized(s)), tree)

    # -- caches and activations -----------------------------------------------------------------
    def cache_shardings(self, cache_shapes) -> dict:
        """Shardings for KV pools (arrays or ShapeDtypeStructs), their leaves named by `CACHE_AXES`."""
        return jax.tree_util.tree_map(lambda a: self.sharding(a.shape, cache_leaf_axes(len(a.shape))), cache_shapes)

    def batch_sharding(self, shape) -> NamedSharding:
        return self.sharding(shape, ("batch",) + (None,) * (len(shape) - 1))

    def put(self, x, sharding: NamedSharding | None = None) -> jax.Array:
        """Host data (identical in every process) -> one global array, each process filling its shards."""
        x = np.asarray(x)
        sharding = sharding or self.replicated
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def get(self, x) -> np.ndarray:
        """A global array -> host numpy in every process (gathered when not all local)."""
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def scale_shape_axes(spec: ParamSpec, blockwise: bool = False) -> tuple[tuple[int, ...], tuple]:
    """Shape and axes of a weight's int8 scales: the output dims, after any stacked layer axis.
    `blockwise`: its FP8 block scales (`quant.fp8_ratios`), a dim divided into blocks unsharded."""
    lead = 1 if spec.axes and spec.axes[0] == "layers" else 0
    if blockwise:
        ratios = fp8_ratios(spec.shape, lead + spec.n_batch, spec.n_contract)
        shape = tuple(d // r for d, r in zip(spec.shape, ratios))
        return shape, tuple(a if r == 1 else None for a, r in zip(spec.axes, ratios))
    if spec.n_contract == 0:  # an embedding table: one scale per row, [V, 1]
        return spec.shape[: lead + 1] + (1,), spec.axes[: lead + 1] + (None,)
    lead += getattr(spec, "n_batch", 0)  # independent matrices (experts) keep their own scales
    keep = slice(lead + spec.n_contract, None)
    return spec.shape[:lead] + spec.shape[keep], spec.axes[:lead] + spec.axes[keep]


def single_device_layout() -> Layout:
    return Layout(make_mesh(tp=1, dp=1, devices=jax.devices()[:1]))


def layout_for(tp: int | None, dp: int = 1) -> Layout:
    """The layout `jaxllm.load(tp=...)` uses: tp=None means every device."""
    return Layout(make_mesh(tp=tp, dp=dp))


def check_divisible(layout: Layout, tree: dict) -> None:
    """Raise the one-line ModelError for an impossible split before any weight is read."""
    specs = jax.tree_util.tree_leaves(tree, is_leaf=is_spec)
    order = list(MUST_SPLIT)  # report query heads before MLP width before the rest
    for s in sorted(specs, key=lambda s: min([order.index(a) for a in s.axes if a in order] or [9])):
        layout.spec(s.shape, s.axes)
