"""The XLA backend: the reference implementation of every operation the model calls, the path on
CPUs, and what the GPU and TPU backends fall back to. The math here is plain `jax.numpy`; XLA fuses
it (the int8 dequantization into the dot's epilogue, the norms into their neighbours)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxllm.config.model import RopeSpec
from jaxllm.config.runtime import RuntimeConfig
from jaxllm.errors import ModelError
from jaxllm.quant import QuantArray, operand

NEG_INF = -1e30
# A bfloat16 KV cache held as its bits (`XlaOps.kv_dtype`; `kv.blockwise.to_store` and `from_store`
# read and write it): XLA's CPU backend computes a bfloat16 scatter or dynamic-update-slice in
# float32, converting the whole buffer there and back, so every token written into a bfloat16 cache
# cost a pass over the cache; an integer buffer is updated in place.
PACKED = jnp.uint16
CPU_COND_POSITIONS = 2048  # `XlaOps.layer_scan`: a CPU's smaller caches take a conditional per layer


# -- the math ----------------------------------------------------------------------------------------
def rms_norm(x: jax.Array, w: jax.Array | None, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32; `offset=1` is Gemma's (1 + w) scaling, `w=None` is parameter-free."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if w is not None:
        y = y * (offset + w.astype(jnp.float32))
    return y.astype(x.dtype)


def inv_frequencies(rope: RopeSpec, head_dim: int) -> np.ndarray:
    """Inverse frequencies over head_dim/2 pairs, the way Hugging Face computes them per rope type."""
    if rope.kind in ("default", "linear"):
        inv = 1.0 / rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    elif rope.kind == "proportional":
        n_rot = int(rope.partial * head_dim // 2)
        inv = 1.0 / rope.theta ** (np.arange(0, 2 * n_rot, 2, dtype=np.float64) / head_dim)
        inv = np.concatenate([inv, np.zeros(head_dim // 2 - n_rot)])
    else:
        raise ModelError(f"unsupported rope type {rope.kind!r} (supported: default, linear, proportional)")
    return (inv / rope.factor).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x [B, T, H, hd], positions [B, T] (absolute). Rotates halves, as HF's rotate_half does."""
    ang = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, hd/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    raise ModelError(f"unsupported activation {name!r}")


def attention_mask(q_pos: jax.Array, kv_pos: jax.Array, window: int | None) -> jax.Array:
    """[B, T, S] bool: causal, within the sliding window, and only slots that hold a written key.

    `kv_pos[b, s]` is the absolute position of key s (or -1 for none): the positions a block of a
    row's KV stands for, which a sliding layer's table reuses, so the mask reads them.
    """
    qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
    m = (kp <= qp) & (kp >= 0)
    if window is not None:
        m &= kp > qp - window
    return m


def attend(q, k, v, mask, scale: float, softcap: float | None) -> jax.Array:
    """Grouped-query attention. q [B,T,H,hd], k/v [B,S,K,hd], mask [B,T,S] -> [B,T,H,hd]."""
    B, T, H, hd = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, hd)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(mask[:, None, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, hd).astype(q.dtype)


def matmul(x: jax.Array, w, n_contract: int = 1, out_major: bool = False, out_dtype=jnp.float32) -> jax.Array:
    """Contract the last `n_contract` dims of x with the first `n_contract` dims of w (its last
    ones where `out_major`), w an array or a QuantArray. The output is x's leading dims followed by
    w's output dims, so a per-output-channel scale broadcasts on the trailing dims and XLA fuses
    the dequantization into the dot's epilogue; block scales (FP8) scale the values as the dot
    reads them (`quant.operand`). A product without a scale left is written as `out_dtype` (the
    sums are float32 either way) and returned as x's dtype."""
    xa = tuple(range(x.ndim - n_contract, x.ndim))
    nd = len(w.shape)
    wa = tuple(range(nd - n_contract, nd)) if out_major else tuple(range(n_contract))
    w, scale = operand(w, x.dtype)
    if scale is not None:
        y = jax.lax.dot_general(x, w, ((xa, wa), ((), ())), preferred_element_type=jnp.float32)
        return (y * scale).astype(x.dtype)
    return jax.lax.dot_general(x, w, ((xa, wa), ((), ())), preferred_element_type=out_dtype).astype(x.dtype)


def memory_limit(device) -> int | None:
    """The bytes `device` lets this process allocate, where its runtime says (None elsewhere)."""
    try:
        return (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # a backend without memory statistics
        return None


def take_rows(table, ids: jax.Array, dtype) -> jax.Array:
    """Embedding lookup from a plain or row-quantized table."""
    if isinstance(table, QuantArray):
        rows = jnp.take(table.q, ids, axis=0).astype(jnp.float32)
        return (rows * jnp.take(table.scale, ids, axis=0)).astype(dtype)
    return jnp.take(table, ids, axis=0).astype(dtype)


def matmul_rows(h: jax.Array, table) -> jax.Array:
    """h [..., D] against every row of a table [V, D] -> float32 [..., V] (tied output head)."""
    if isinstance(table, QuantArray):
        out = jnp.einsum("...d,vd->...v", h, table.q.astype(h.dtype), preferred_element_type=jnp.float32)
        return out * table.scale[:, 0]
    return jnp.einsum("...d,vd->...v", h, table.astype(h.dtype), preferred_element_type=jnp.float32)


# -- the interface's argument types ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HeadPrep:
    """How projections become attention inputs: RMS norms (weights [hd] or None), RoPE's inverse
    frequencies over the two halves of the head, and whether values get a weightless norm. A
    backend may hand the norm weights over in its own form (see `Ops.layer_weights`); `norm_layer`
    is for its kernels."""

    inv_freq: np.ndarray  # [hd / 2]
    q_norm: object = None
    k_norm: object = None
    v_norm: bool = False
    eps: float = 1e-6
    offset: float = 0.0
    norm_layer: jax.Array | int = 0


@dataclasses.dataclass(frozen=True)
class KeysFromValues:
    """Keys as `rope(rms_norm(v) * (offset + norm_w))` of the stored values (norm_w None: no norm),
    for a cache that keeps only values (K = V before the norms)."""

    inv_freq: np.ndarray  # [hd / 2]
    norm_w: jax.Array | None  # [hd]
    eps: float = 1e-6
    offset: float = 0.0


# -- the backend -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class XlaOps:
    """The operations the model calls, in XLA. `layout` is the `model.sharding.Layout` whose mesh
    what is traced runs on (None: one device). The GPU backend (`ops.gpu.backend.PallasOps`)
    subclasses this and overrides what its kernels do faster; everything else is this."""

    runtime: RuntimeConfig = RuntimeConfig()
    layout: object = None
    name = "xla"

    # --- where things run
    @property
    def platform(self) -> str:
        return jax.default_backend() if self.layout is None else self.layout.mesh.devices.flat[0].platform

    @property
    def top_p_by(self) -> str:
        """How the sampler finds top-p cut-offs: sorting on GPUs (an H100 sorts [8, 262144] floats
        in 0.6 ms, under half the bisection's time), bisection elsewhere (on a CPU about a tenth of
        the sort's time)."""
        return "sort" if self.platform == "gpu" else "bisection"

    @property
    def first_run_costs(self) -> bool:
        """Whether a compiled call's first run costs more than its next ones, so that a server runs
        each call once before a request waits on it: a GPU loads the call's kernels and builds its
        command buffers then (20 to 60 ms a call on one H100). On a CPU the first run costs what the
        next ones do (the embedded model's server's calls on this project's CPU machine), and a run
        with nothing to do still computes everything (a prefill of padding rows is seconds long)."""
        return self.platform == "gpu"

    @property
    def prefill_tokens(self) -> int:
        """The prompt tokens a server's prefill forward takes unless told (`--max-num-batched-tokens`):
        8192 on a GPU whose allocator may hold at least 40 GiB, as vLLM's server on GPUs of 70 GiB and
        more (64 prompts of 100 tokens in one forward: the Qwen3-4B shape on one H100 prefills them
        in 125 ms, against 151 ms in four forwards of 16), else 2048."""
        if self.platform != "gpu":
            return 2048
        device = jax.local_devices()[0] if self.layout is None else self.layout.mesh.devices.flat[0]
        limit = memory_limit(device)
        return 8192 if limit is not None and limit >= 40 << 30 else 2048

    def layer_scan(self, cache_positions: int = 0) -> str:
        """`cond` or `period` (see `RuntimeConfig.layer_scan`) for a step over a cache of
        `cache_positions` (rows x positions). With a conditional per layer, XLA copies the KV-cache
        stacks a branch passes through (on a GPU it also decides the conditional on the host, a
        device-to-host copy and a wait each layer): the embedded model's decode loop compiled for a
        v6e holds 10 copies of cache stacks that way and none with periods, and on this project's
        CPU machine 8 decode steps over 1 x 8192 positions took 0.83 s with periods against 0.93,
        over 4 x 4096 0.79 against 1.47. So `auto` takes periods, except on a CPU for a cache of
        fewer than `CPU_COND_POSITIONS`, where the copies are small and the conditional's loop
        runs faster (`jaxllm.infer` answering one prompt with the embedded model, its cache 1 x
        64: 16.2 to 16.6 tok/s against 12.4 to 13.0 with periods)."""
        m = self.runtime.layer_scan
        if m != "auto":
            return m
        return "cond" if self.platform == "cpu" and cache_positions < CPU_COND_POSITIONS else "period"

    def kv_dtype(self, dtype):
        """The dtype a KV cache of compute dtype `dtype` keeps its values in: on a CPU a bfloat16
        cache keeps their bits in uint16 (`PACKED`), which XLA's CPU backend writes in
        place (the embedded model's decode steps over one live slot of a cache of 8 slots of
        2048 positions took 510 ms each on this project's CPU machine with a bfloat16 store,
        against 125 ms with the packed one)."""
        if self.platform == "cpu" and jnp.dtype(dtype) == jnp.bfloat16:
            return PACKED
        return dtype

    def compiler_options(self) -> dict:
        """XLA options the engine compiles its calls with. On GPUs, XLA's Triton GEMMs stay off
        unless `RuntimeConfig.triton_gemm`: autotuning them made up most of a cold server's
        compiling (Qwen3-4B, 64 slots, one H100: ready 23.6 s without against 30.2 with), and the
        cuBLAS GEMMs it then takes were as fast (a 2048-token prefill 40.2 ms against 42.5)."""
        if self.platform == "gpu" and not self.runtime.triton_gemm:
            return {"xla_gpu_enable_triton_gemm": False}
        return {}

    def scan_unroll(self, num_layers: int, rows: int, tokens_per_row: int) -> int:
        """Layers per iteration of the layer scan: the configured count, else one (unrolled, a
        prefill or an XLA decode step compiles larger for no gain)."""
        u = self.runtime.scan_unroll
        if u is None:
            return 1
        return num_layers if u == "full" else min(u, num_layers)

    # --- weights
    def prepare_weights(self, weights: dict, specs: dict, donate: bool = False) -> dict:
        """The weights laid out for this backend, once after loading; `specs` describes them
        (`model.params`: each weight's shape, logical axes and role)."""
        return weights

    def loop_weights(self, weights, rows: int, state=None, dtype=jnp.bfloat16):
        """The weights as a decode call's loop reads them, `rows` tokens a step, `state` (the cache
        and slot table) beside them: here as they are (XLA on CPUs and TPUs fuses the int8
        widening into each matmul)."""
        return weights

    def layer_weights(self, group: dict, idx, specs: dict) -> dict:
        """Layer `idx` of a group of stacked layer weights, in the form this backend's operations
        take; `specs` describes the group's stacks (`model.params.ParamSpec`), whose `role` says
        which the layer hands only to this backend's operations."""
        return jax.tree_util.tree_map(lambda a: a[idx], group)

    def weight(self, w):
        """A layer weight as `layer_weights` gave it, as an array (for code outside this backend)."""
        return w

    def value(self, y):
        """An operation's result as an array (a backend may defer a sum or a norm to the next operation)."""
        return y

    # --- the layer's operations
    def rms_norm(self, x, w, eps: float, offset: float = 0.0):
        return rms_norm(x, w, eps, offset)

    # The residual stream between layers is (x, h): x, and h the next layer's input (x normed with
    # that layer's `attn_norm`) where the backend computes it as the previous layer ends, or None
    # where it leaves the norm to the layer itself (to fuse it into the Q/K/V projections).
    def next_input(self, x, next_norm, eps: float, offset: float = 0.0):
        """The stream (x, h) entering a layer whose input norm is `next_norm`."""
        return x, rms_norm(x, next_norm, eps, offset)

    def layer_input(self, x, h, norm, eps: float, offset: float = 0.0):
        """A layer's normed input from the stream (x, h); `norm` is its `attn_norm`."""
        return rms_norm(x, norm, eps, offset) if h is None else h

    def linear(self, x, w, n_contract: int = 1, partials: bool = False):
        """x's last `n_contract` dims contracted with w's input dims. With `partials` the result may
        stay in the backend's own form for another of its operations (`add_norm`, `head_prologue`)."""
        return matmul(self.value(x), w, n_contract)

    def linears(self, x, ws: list, n_contract: int = 1, partials: bool = False) -> list:
        x = self.value(x)
        return [matmul(x, w, n_contract) for w in ws]

    def gated_mlp(self, x, gate, up, down, act: str, partials: bool = False):
        """down(act(x @ gate) * (x @ up))."""
        x = self.value(x)
        return matmul(activation(act, matmul(x, gate)) * matmul(x, up), down)

    def add_norm(self, x, y, post, pre, eps: float, offset: float = 0.0):
        """The residual add after a block and the next block's input norm: (x + rms_norm(y, post),
        or x + y with `post` None; and that normed with `pre`)."""
        y = self.value(y)
        if post is not None:
            y = rms_norm(y, post, eps, offset)
        x = x + y
        return x, rms_norm(x, pre, eps, offset)

    def close_layer(self, x, y, post, next_norm, eps: float, offset: float = 0.0, h_into=None):
        """The residual add that closes a layer -> the stream (x, h) entering the next (`add_norm`);
        `h_into` is a buffer of x's shape the caller no longer needs, which a backend may reuse."""
        return self.add_norm(x, y, post, next_norm, eps, offset)

    def head_prologue(self, q, k, v, prep: HeadPrep, positions, layer_cache):
        """Raw projections [B, T, heads, hd] -> (q, k, v, layer_cache): per-head norms and RoPE on
        Q and K, the weightless norm on V; k and v come back None where this step's keys and values
        were already written into `layer_cache` (which comes back updated). k, v None on the way in:
        queries alone, for a layer that attends over another layer's cache."""
        q = apply_rope(self._norm_heads(q, prep.q_norm, prep), positions, prep.inv_freq)
        if k is None:
            return q, None, None, layer_cache
        k = apply_rope(self._norm_heads(k, prep.k_norm, prep), positions, prep.inv_freq)
        v = self.value(v)
        if prep.v_norm:
            v = rms_norm(v, None, prep.eps)
        return q, k, v, layer_cache

    def _norm_heads(self, x, w, prep: HeadPrep):
        x = self.value(x)
        return x if w is None else rms_norm(x, w, prep.eps, prep.offset)

    def paged_attention(self, q, layer_kv, positions, *, scale, softcap, window, keys=None):
        """Attention of q [B, T, H, hd] at positions [B, T] over a layer of a paged KV pool
        (`kv.paged.LayerKV`: the pool, the layer, the rows' block tables), or None where the
        cache's own XLA formulation (a blockwise loop over the rows' blocks) should run. `keys`:
        how keys are rebuilt from stored values (`KeysFromValues`), for a pool that keeps none."""
        return None

    def embed(self, table, ids, dtype):
        """Token embeddings. On a tensor-parallel mesh with the table's vocabulary sharded, each
        device looks up the ids in its own rows (zeros elsewhere) and the rows are summed over the
        model axis: no device gathers the table."""
        rows = self._embed_sharded(table, ids, dtype)
        return take_rows(table, ids, dtype) if rows is None else rows

    def output_head(self, h, table, tied: bool):
        """float32 logits [..., V] of h [..., D]: against every row of a tied embedding table [V, D],
        or through an untied lm_head [D, V]."""
        return matmul_rows(h, table) if tied else matmul(h, table).astype(jnp.float32)

    def _embed_sharded(self, table, ids, dtype):
        layout = self.layout
        if layout is None or layout.tp == 1:
            return None

        q, scale = (table.q, table.scale) if isinstance(table, QuantArray) else (table, None)
        tspec = layout.spec(q.shape, ("vocab", "embed"))
        if tspec[0] is None:
            return None
        rows_local = q.shape[0] // layout.tp
        ispec = layout.spec(ids.shape, ("batch",) + (None,) * (ids.ndim - 1))

        def body(q, ids, *scale):
            local = ids - jax.lax.axis_index("model") * rows_local
            hit = (local >= 0) & (local < rows_local)
            local = jnp.clip(local, 0, rows_local - 1)
            rows = jnp.take(q, local, axis=0).astype("float32")
            if scale:
                rows = rows * jnp.take(scale[0], local, axis=0)
            rows = jnp.where(hit[..., None], rows, 0.0)
            return jax.lax.psum(rows, "model").astype(dtype)

        in_specs = (tspec, ispec) + ((tspec,) if scale is not None else ())
        args = (q, ids) + ((scale,) if scale is not None else ())
        return jax.shard_map(body, mesh=layout.mesh, in_specs=in_specs, out_specs=P(*ispec, None), check_vma=False)(
            *args
        )
