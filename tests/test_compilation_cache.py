"""JAX's persistent compilation cache, as every front end turns it on: a second process compiling
the same steps reads them from the cache folder."""
import json
import os
import subprocess
import sys

import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import json, sys
import jax
from jaxllm.compilation_cache import enable
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
assert enable(sys.argv[2]) is not None
import jaxllm
eng = jaxllm.load(sys.argv[1], quant="none", dtype="float32", max_ctx=64)
eng.generate_ids([[1, 2, 3]], max_tokens=6)
print(json.dumps({"hits": len(hits), "compile_s": eng.stats.compile_s}))
"""


def test_second_process_reads_the_compiled_steps(tmp_path):
    tiny.make("gemma3", tmp_path / "m")
    cache = tmp_path / "xla"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m"), str(cache)], capture_output=True,
                           text=True, timeout=600, env=env, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(runs)
    assert any(cache.iterdir())                      # the first run wrote the folder
    assert runs[1]["hits"] >= 2                      # the prefill and the decode loop, at least
    assert runs[1]["compile_s"] < runs[0]["compile_s"]


def test_off_and_folder_resolution(tmp_path, monkeypatch):
    from jaxllm import compilation_cache as cc
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("JAXLLM_COMPILATION_CACHE", raising=False)
    assert cc.resolve() == tmp_path / "jaxllm" / "xla"
    assert cc.resolve("off") is None and cc.resolve(str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.setenv("JAXLLM_COMPILATION_CACHE", "off")
    assert cc.resolve() is None and cc.resolve(str(tmp_path / "y")) == tmp_path / "y"
