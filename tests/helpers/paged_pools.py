"""Random paged KV pools for the kernel tests: pools of random keys and values (int8 with their
scales), block tables whose rows name distinct blocks in a shuffled order (block 0, the null
block, never), and the reference reading of a row's logical positions through its table."""
import jax.numpy as jnp
import numpy as np

from jaxllm.kv.blockwise import dequantize_kv, quantize_kv


def pool(rng, L, N, P, K, hd, *, int8=False, keys=True, dtype=jnp.float32):
    """(arrays {"k", "v"[, "k_scale", "v_scale"]} of a pool [L, N, P, K, hd], and the float32 values
    they hold {"k", "v"}). keys=False: a pool of values alone."""
    vals = {n: jnp.asarray(rng.standard_normal((L, N, P, K, hd)), jnp.float32) for n in ("k", "v")[not keys:]}
    if not int8:
        arrays = {n: a.astype(dtype) for n, a in vals.items()}
        return arrays, {n: a.astype(jnp.float32) for n, a in arrays.items()}
    arrays = {}
    for n, a in vals.items():
        arrays[n], arrays[n + "_scale"] = quantize_kv(a)
    return arrays, {n: dequantize_kv(arrays[n], arrays[n + "_scale"], jnp.float32) for n in vals}


def table(rng, B, M, N):
    """[B, M] int32: each row M distinct blocks of 1..N-1, shuffled (non-contiguous, out of order)."""
    return jnp.asarray(np.stack([rng.permutation(np.arange(1, N))[:M] for _ in range(B)]), jnp.int32)


def logical(a, table, layer, S):
    """[B, S, ...]: positions 0..S-1 of every row of layer `layer` of pool leaf a [L, N, P, ...],
    read as the kernels read them (position p at block table[b, (p // P) % M], offset p % P)."""
    P, M = a.shape[2], table.shape[1]
    p = np.arange(S)
    return a[layer][np.asarray(table)[:, (p // P) % M], p % P]
