"""Compiled steps kept on disk, as `jaxllm.load` turns them on: a second process compiling the
same steps reads them (JAX's compilation cache for any program, the engine's executables for its
prefill and decode calls), and a damaged executable is compiled again. Within a process, a new
prompt length or max_tokens in the same bucket compiles nothing."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import json, sys
import jax
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
import jaxllm
runtime = jaxllm.RuntimeConfig(**json.loads(sys.argv[3]))
eng = jaxllm.load(sys.argv[1], quant="none", dtype="float32", max_ctx=64, runtime=runtime)
assert eng.runtime == runtime
if sys.argv[2] == "xla":
    eng.steps_cache = None                  # JAX's cache alone
out = eng.generate_ids([[1, 2, 3]], max_tokens=6)[0].token_ids
c = eng.compiles
print(json.dumps({"hits": len(hits), "tokens": out, "compiled": c.compiled, "from_jax_cache": c.from_jax_cache,
                  "read": c.read}))
"""


def run(model, cache, mode, **runtime):
    """One process loading the model with `jaxllm.load` as a user does, the compilation cache's
    folder `cache` named by the environment alone, and generating; `runtime`: its `RuntimeConfig`
    (default: the defaults)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "JAXLLM_COMPILATION_CACHE": str(cache)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(model), mode, json.dumps(runtime)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_second_process_reads_the_compiled_steps(tmp_path):
    tiny.make("gemma3", tmp_path / "m")
    xla, steps = tmp_path / "xla", tmp_path / "steps"
    first, _ = run(tmp_path / "m", xla, "xla")              # JAX's cache alone
    second, _ = run(tmp_path / "m", xla, "xla")
    assert any(xla.iterdir()) and second["hits"] >= 2      # the prefill and the decode loop, at least
    cold, _ = run(tmp_path / "m", steps, "steps")           # the engine's executables too, by default
    files = sorted((steps / "executables").glob("*.bin"))
    assert len(files) == 2 and (cold["compiled"], cold["read"]) == (2, 0)
    warm, _ = run(tmp_path / "m", steps, "steps")
    print(first, second, cold, warm)
    # the engine's record: both calls read back whole, none compiled (not even traced)
    assert warm["hits"] == 0 and (warm["compiled"], warm["read"]) == (0, 2)
    assert first["tokens"] == second["tokens"] == cold["tokens"] == warm["tokens"]
    # another runtime configuration (another layer scan) is another key: compiled and kept anew,
    # nothing read from the first configuration's executables
    other, _ = run(tmp_path / "m", steps, "steps", layer_scan="period")
    assert len(set((steps / "executables").glob("*.bin")) - set(files)) == 2 and all(f.exists() for f in files)
    assert (other["compiled"], other["read"]) == (2, 0)
    for f in set((steps / "executables").glob("*.bin")) - set(files):
        f.unlink()                                          # the rest below counts the first two alone
    files[0].write_bytes(files[0].read_bytes()[:100])      # damaged: compiled again, with a warning
    again, err = run(tmp_path / "m", steps, "steps")
    assert again["tokens"] == cold["tokens"] and "unreadable" in err and "Traceback" not in err
    assert (again["read"], again["compiled"], again["from_jax_cache"]) == (1, 1, 1)
    # compiled again from JAX's cache, which a CPU executable cannot be serialized back from whole:
    # not kept, so the next process runs (from JAX's cache) rather than failing at its first call
    assert not files[0].exists() and files[1].exists()
    last, err = run(tmp_path / "m", steps, "steps")
    assert last["tokens"] == cold["tokens"] and "Traceback" not in err


def test_lengths_in_one_bucket_compile_nothing_new(tmp_path):
    """A prompt of 5 tokens with max_tokens 20, then one of 9 with 27 (two `jaxllm.infer` runs'
    shapes): the second makes no new program, by the engine's own record; nor do two prompts of
    mixed lengths (the scheduler's path) after two others of other lengths."""
    import jaxllm
    tiny.make("qwen3", tmp_path / "m", seed=2)
    eng = jaxllm.load(str(tmp_path / "m"), quant="none", dtype="float32", max_ctx=256, compilation_cache="off")
    assert not eng.cfg.eos_ids            # every answer runs to max_tokens: the same calls, whatever it samples
    a, b = (np.random.default_rng(n).integers(1, 160, n).tolist() for n in (5, 9))
    eng.generate_ids([a], max_tokens=20)
    made = eng.compiles.programs
    assert (eng.compiles.compiled, eng.compiles.allocators) == (2, 1)     # the prefill and the decode loop
    assert len(eng.generate_ids([b], max_tokens=27)[0].token_ids) == 27
    assert eng.compiles.programs == made
    eng.generate_ids([a, b], max_tokens=20)
    made = eng.compiles.programs
    assert [len(c.token_ids) for c in eng.generate_ids([b + a, a[:3]], max_tokens=27)] == [27, 27]
    assert eng.compiles.programs == made


def test_off_and_folder_resolution(tmp_path, monkeypatch):
    """The folders a front end keeps things in, read from the environment once (`Caches.from_env`);
    below it nothing reads the environment, and the default keeps nothing."""
    from jaxllm.config.runtime import Caches
    from jaxllm.engine import compilation_cache as cc
    for name in ("JAXLLM_COMPILATION_CACHE", "JAXLLM_CACHE", "XLA_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    got = Caches.from_env()
    assert (got.folder, got.compilation) == (tmp_path / "jaxllm", tmp_path / "jaxllm" / "xla")
    assert Caches.from_env("off").compilation is None
    assert Caches.from_env(str(tmp_path / "x")).compilation == tmp_path / "x"
    monkeypatch.setenv("JAXLLM_COMPILATION_CACHE", "off")
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "own"))
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/dev/null")
    got = Caches.from_env()
    assert got.compilation is None and got.folder == tmp_path / "own"
    assert ("XLA_FLAGS", "--xla_dump_to=/dev/null") in got.compile_env
    assert Caches.from_env(str(tmp_path / "y")).compilation == tmp_path / "y"
    assert Caches() == Caches(folder=None, compilation=None, weights=False)
    assert cc.enable(None) is None and cc.executables_folder(None) is None


def test_executable_keys_cover_the_whole_package():
    """A kept executable's key hashes the source of every part of the package, the kernels and the
    model included, not only the engine's: a change to a kernel's tiles is a different program."""
    from jaxllm.engine import compilation_cache as cc
    names = {str(f.relative_to(cc.PACKAGE)) for f in cc.sources()}
    for part in ("engine/core.py", "model/forward.py", "ops/xla.py", "ops/gpu/matmul.py", "kv/paged.py"):
        assert part in names, part


def test_compile_all_keeps_the_order_of_its_items():
    """Programs compiled together on threads come back in the order of the items they were made
    from, each the program of its own item."""
    import jax
    import jax.numpy as jnp

    from jaxllm.compiling import compile_all
    items = [1.0, 2.0, 3.0, 4.0, 5.0]
    made = compile_all(items, lambda c: jax.jit(lambda x: x * c + jnp.arange(3.0)).lower(jnp.zeros(3)), threads=3)
    for c, exe in zip(items, made):
        assert jnp.array_equal(exe(jnp.ones(3)), c + jnp.arange(3.0))
    assert compile_all([], lambda c: None) == []
    from jaxllm.compiling import map_threads
    assert map_threads(lambda c: 2 * c, items, threads=3) == [2 * c for c in items] and map_threads(len, []) == []


@pytest.fixture
def without_jax_cache():
    """JAX's persistent cache off in this process for one test. A front end run in process earlier
    in the worker turns it on, and a program it answers is not kept as an executable
    (`compile_and_keep`): whether a test's programs were compiled before in the run (or in an
    earlier run, the folder being shared) must not decide what it sees."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jcc
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jcc.reset_cache()                     # JAX decides once a process whether the cache is used
    yield
    jax.config.update("jax_enable_compilation_cache", was)
    jcc.reset_cache()


def test_warmup_reads_every_call_back(tmp_path, monkeypatch, without_jax_cache):
    """A second engine of the same model warms a server's scheduler from the executables the first
    one kept: every call is read back (on threads), none traced again."""
    import jaxllm
    from jaxllm.engine.scheduler import Scheduler
    tiny.make("qwen3", tmp_path / "m", seed=1)

    def scheduler():
        eng = jaxllm.load(str(tmp_path / "m"), quant="none", dtype="float32", max_ctx=64)
        eng.steps_cache = tmp_path / "steps"
        return eng, Scheduler(eng, max_num_seqs=2, max_model_len=64, max_queue=4, max_num_batched_tokens=16)
    first, sched = scheduler()
    sched.warmup.compile(background=False)
    assert len(list((tmp_path / "steps").glob("*.bin"))) == len(first._executables) > 2
    second, sched = scheduler()
    monkeypatch.setattr(second, "_lower", lambda *a: pytest.fail(f"traced {a[0]} again"))
    sched.warmup.compile(background=False)
    assert set(second._executables) == set(first._executables)


def test_a_stored_step_for_other_devices_is_compiled_again(tmp_path, caplog):
    """An executable read back whose inputs lie on other devices than the engine's mesh (a file
    that is not what its key says) is not run: the call is compiled again, with a warning."""
    import types

    import jaxllm
    tiny.make("qwen3", tmp_path / "m", seed=1)
    eng = jaxllm.load(str(tmp_path / "m"), quant="none", dtype="float32", max_ctx=64, compilation_cache="off")
    mine = types.SimpleNamespace(device_set=set(eng.layout.mesh.devices.flat))
    other = types.SimpleNamespace(device_set={"another device"})
    ok = types.SimpleNamespace(input_shardings=((mine, mine), {}))
    assert eng._on_mesh(ok, "k") is ok and eng._on_mesh(None, "k") is None
    assert eng._on_mesh(types.SimpleNamespace(input_shardings=((mine, other), {})), "k") is None
    assert "other devices" in caplog.text
