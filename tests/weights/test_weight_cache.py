"""The per-user cache of models built from GGUF files (jaxllm.weights.weight_cache)."""
import json
import os
import shutil
import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gguf import _gemma3_metadata, _write

import jaxllm.weights.gguf as gguf_module
from jaxllm.config.runtime import Caches
from jaxllm.errors import ModelError
from jaxllm.weights import locate
from jaxllm.weights import weight_cache as wcache
from jaxllm.weights.loader import load_model


def write_tiny_gguf(path, seed=0, n_layers=2):
    """A loadable two-layer gemma3 GGUF: Q8_0 projections (so loading dequantizes), F32 norms."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    _gemma3_metadata(w, n_layers=n_layers)

    def linear(name, rows, cols):
        a = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    w.add_tensor("token_embd.weight", rng.standard_normal((5, 256)).astype(np.float32))
    for i in range(n_layers):
        for name, rows, cols in (("attn_q", 256, 256), ("attn_k", 256, 256), ("attn_v", 256, 256),
                                 ("attn_output", 256, 256), ("ffn_gate", 512, 256), ("ffn_up", 512, 256),
                                 ("ffn_down", 256, 512)):
            linear(f"blk.{i}.{name}.weight", rows, cols)
        for name in ("attn_q_norm", "attn_k_norm", "attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(256)).astype(np.float32))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(256)).astype(np.float32))
    _write(w)
    return path


@pytest.fixture
def tiny(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    return write_tiny_gguf(d / "tiny.gguf")


KEPT = {"caches": Caches()}  # what `load` keeps, unless told


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setitem(KEPT, "caches", Caches(folder=tmp_path / "cache", weights=True))
    return tmp_path / "cache" / "weights"


@pytest.fixture
def builds(monkeypatch):
    """How many times a load read a GGUF file's tensors to dequantize them."""
    calls = []
    real = gguf_module.GGUFSource

    def counted(path):
        calls.append(path)
        return real(path)
    monkeypatch.setattr(gguf_module, "GGUFSource", counted)
    return calls


def load(path, quant="int8", dtype=jnp.float32, caches=None):
    """load_model, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = load_model(path, dtype, quant, caches=caches or KEPT["caches"])
    return out, [str(w.message) for w in caught]


def magic(path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def entries(cache):
    return sorted(p.name for p in cache.glob("*") if p.name != "digests") if cache.exists() else []


def assert_same_model(a, b):
    cfg_a, fam_a, w_a, tok_a, name_a = a
    cfg_b, fam_b, w_b, tok_b, name_b = b
    assert (cfg_a, fam_a, name_a) == (cfg_b, fam_b, name_b)
    leaves_a, tree_a = jax.tree_util.tree_flatten(w_a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(w_b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for field in ("bos_id", "eos_ids", "add_bos", "chat_template", "chat_tuned", "bos_token"):
        assert getattr(tok_a, field) == getattr(tok_b, field), field
    assert tok_a.tok.get_vocab() == tok_b.tok.get_vocab()


@pytest.mark.parametrize("quant,dtype", [("int8", jnp.float32), ("none", jnp.bfloat16)])
def test_second_load_reads_the_cache(tiny, cache, builds, quant, dtype):
    first, warned = load(tiny, quant, dtype)
    assert not warned and len(builds) == 1
    [name] = entries(cache)
    assert name.split("-")[1:3] == [quant, jnp.dtype(dtype).name]
    second, warned = load(tiny, quant, dtype)
    assert not warned and len(builds) == 1           # restored, not dequantized
    assert_same_model(first, second)
    assert entries(cache) == [name]
    assert os.listdir(tiny.parent) == [tiny.name]    # nothing written beside the model


def test_other_quant_or_dtype_is_another_entry(tiny, cache, builds):
    load(tiny, "int8", jnp.float32)
    load(tiny, "none", jnp.float32)
    load(tiny, "int8", jnp.bfloat16)
    assert len(builds) == 3 and len(entries(cache)) == 3


def damage_data_file(entry):
    """Truncate the largest file of the orbax checkpoint (array data)."""
    files = [p for p in (entry / "weights").rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 3)


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("damage", [
    damage_data_file,
    lambda e: (e / "jaxllm.json").unlink(),
    lambda e: (e / "tokenizer.json").write_text("{not json"),
    lambda e: shutil.rmtree(e / "weights" / "ocdbt.process_0"),
    lambda e: edit_json(e / "config.json", intermediate_size=384),
], ids=["truncated-data", "no-meta", "bad-tokenizer", "missing-data", "wrong-shapes"])
def test_damaged_entry_is_rebuilt_with_one_warning(tiny, cache, builds, damage):
    first, warned = load(tiny)
    assert not warned
    [name] = entries(cache)
    damage(cache / name)
    second, warned = load(tiny)
    assert len(warned) == 1 and "damaged" in warned[0] and name in warned[0], warned
    assert len(builds) == 2
    assert_same_model(first, second)
    third, warned = load(tiny)                       # the rebuilt entry is good
    assert not warned and len(builds) == 2 and entries(cache) == [name]
    assert_same_model(first, third)


def test_changed_file_is_not_served_stale_weights(tiny, cache, builds):
    first, _ = load(tiny)
    write_tiny_gguf(tiny, seed=1)
    second, _ = load(tiny)
    assert len(builds) == 2 and len(entries(cache)) == 2
    fresh, _ = load(tiny, caches=Caches())
    assert_same_model(second, fresh)
    assert not np.array_equal(np.asarray(first[2]["final_norm"]), np.asarray(second[2]["final_norm"]))


def test_digest_is_hashed_once(tiny, cache, monkeypatch):
    load(tiny)
    monkeypatch.setattr(wcache, "_sha256", lambda p: pytest.fail("hashed again"))
    assert wcache.file_digest(tiny, cache.parent) is not None


def test_turned_off(tiny, cache, builds, monkeypatch):
    off = Caches(folder=cache.parent, weights=False)
    load(tiny, caches=off)
    load(tiny, caches=off)
    assert entries(cache) == [] and len(builds) == 2
    # the front ends' setting, read from the environment (`Caches.from_env`)
    monkeypatch.setenv("JAXLLM_CACHE", str(cache.parent))
    monkeypatch.setenv("JAXLLM_WEIGHT_CACHE", "off")
    assert Caches.from_env().weights is False and Caches.from_env(weight_cache=True).weights
    monkeypatch.delenv("JAXLLM_WEIGHT_CACHE")
    assert Caches.from_env() == Caches.from_env(weight_cache=True) and Caches.from_env().folder == cache.parent
    monkeypatch.setenv("JAXLLM_WEIGHT_CACHE", "sometimes")
    with pytest.raises(ModelError, match="JAXLLM_WEIGHT_CACHE must be 'on' or 'off'") as e:
        Caches.from_env()
    assert "\n" not in str(e.value)


def test_unwritable_cache_still_loads(tiny, tmp_path, monkeypatch, builds):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be\n")
    monkeypatch.setitem(KEPT, "caches", Caches(folder=blocker, weights=True))
    first, warned = load(tiny)
    assert len(warned) == 1 and "could not write the weight cache" in warned[0], warned
    second, _ = load(tiny)
    assert len(builds) == 2
    assert_same_model(first, second)


def test_interrupted_write_leaves_no_entry(tiny, cache, builds, monkeypatch):
    from jaxllm.weights import saved

    def dies(d, weights, meta, compress=True):
        (d / "weights").mkdir()
        (d / "weights" / "partial").write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(saved, "save_weights", dies)
    _, warned = load(tiny)
    assert len(warned) == 1 and "No space left on device" in warned[0]
    assert not cache.exists() or [p.name for p in cache.iterdir()] == ["digests"]


def test_concurrent_writer_keeps_the_first_entry(tiny, cache):
    (cfg, _, weights, tok, _), _ = load(tiny)
    entry = wcache.entry_for(tiny, "int8", jnp.float32, KEPT["caches"])
    before = sorted(str(p) for p in entry.path.rglob("*"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wcache.write(entry, locate(tiny), cfg, weights, tok)      # a second writer, finishing later
    assert sorted(str(p) for p in entry.path.rglob("*")) == before
    assert entries(cache) == [entry.path.name]            # its temporary directory is gone


def test_embedded_model_second_load(tmp_path, monkeypatch, builds):
    """The embedded model's entry is found by the package's published sha256: a warm load neither
    reads nor hashes the 240 MB file, nor dequantizes it. The cache holds no copy of the file: a
    first load reads the installed parts in place."""
    from jaxllm.weights import default
    monkeypatch.setitem(KEPT, "caches", Caches(folder=tmp_path, weights=True))
    first, warned = load(None, "int8", jnp.bfloat16)
    assert not warned and len(builds) == 1
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and not [p for p in files if magic(p) == b"GGUF"]
    monkeypatch.setattr(default, "default_model_file", lambda: pytest.fail("read the file again"))
    second, warned = load(None, "int8", jnp.bfloat16)
    assert not warned and len(builds) == 1
    assert_same_model(first, second)
    assert second[3].tok.to_str() == first[3].tok.to_str()
    for text in ("Hello, world!", "<start_of_turn>user\nhi<end_of_turn>\n"):
        assert second[3].encode(text) == first[3].encode(text)
