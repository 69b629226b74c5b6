"""Bad input ends the CLI with one line naming the problem and a non-zero exit, never a traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def infer(*args, timeout=300, **extra_env):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, **extra_env}
    env.pop("JAXLLM_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "jaxllm.infer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def assert_one_line_error(r, *needles):
    """Non-zero exit, no traceback, and exactly one error line (informational lines such as the
    KV-cache size may precede it)."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith(("KV pool", "warning"))]
    assert len(errors) == 1, r.stderr
    for n in needles:
        assert n in errors[0], r.stderr


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    tiny.make("qwen3", d)
    return d


def copy(good, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(good, d)
    return d


def test_missing_directory(tmp_path):
    assert_one_line_error(infer("--model-dir", str(tmp_path / "nope")), "does not exist")


def test_hub_id_not_cached_while_offline(tmp_path):
    r = infer("--model-dir", "no-such-org/no-such-model", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    assert_one_line_error(r, "no-such-org/no-such-model", "cache")


def test_directory_without_config(tmp_path):
    assert_one_line_error(infer("--model-dir", str(tmp_path)), "config.json")


def test_unsupported_model_type(good, tmp_path):
    d = copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(infer("--model-dir", str(d)), "unsupported", "llama")


def test_truncated_safetensors(good, tmp_path):
    d = copy(good, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_one_line_error(infer("--model-dir", str(d)), "truncated")


def _rewrite(d, fn):
    from safetensors.numpy import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(good, tmp_path):
    d = copy(good, tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert_one_line_error(infer("--model-dir", str(d)), "missing", "model.layers.1.mlp.up_proj.weight")


def test_wrong_shape(good, tmp_path):
    d = copy(good, tmp_path)

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
    _rewrite(d, shrink)
    assert_one_line_error(infer("--model-dir", str(d)), "k_proj", "shape")


def test_nothing_written_into_model_dir(good, tmp_path):
    d = copy(good, tmp_path)
    before = sorted((p.name, p.stat().st_size) for p in d.iterdir())
    infer("--model-dir", str(d), "--max-tokens", "2")
    assert sorted((p.name, p.stat().st_size) for p in d.iterdir()) == before


# Runs a front end as `python -m` does, then prints whether JAX had been imported when it ended: a
# refusal that comes before JAX loads comes at once (importing JAX alone takes seconds).
PROBE = ("import atexit, runpy, sys\n"
         "atexit.register(lambda: print('jax imported:', 'jax' in sys.modules))\n"
         "sys.argv = sys.argv[1:]\n"
         "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")
# Loading a model's weights, made to fail loudly: a refusal that must come before any weight is read.
NO_WEIGHTS = ("import jaxllm.weights.loader\n"
              "def load_model(*a, **k):\n"
              "    raise SystemExit('a weight was read')\n"
              "jaxllm.weights.loader.load_model = load_model\n")


def front_end(module, *args, prelude="", cache):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "JAXLLM_CACHE": str(cache)}
    env.pop("JAXLLM_DEBUG", None)
    return subprocess.run([sys.executable, "-c", prelude + PROBE, module, *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def jax_imported(r) -> bool:
    return r.stdout.strip().splitlines()[-1] == "jax imported: True"


@pytest.mark.parametrize("module,flags,needle", [
    ("jaxllm.infer", ["--max-tokens", "0"], "max_tokens"),
    ("jaxllm.infer", ["--max-tokens", "-3"], "max_tokens"),
    ("jaxllm.infer", ["--temperature", "-0.5"], "temperature"),
    ("jaxllm.infer", ["--top-p", "0"], "top_p"),
    ("jaxllm.infer", ["--top-p", "1.5"], "top_p"),
    ("jaxllm.infer", ["--top-k", "-1"], "top_k"),
    ("jaxllm.infer", ["--max-ctx", "0"], "--max-ctx"),
    ("jaxllm.infer", ["--batch", "0"], "--batch"),
    ("jaxllm.infer", ["--bogus-flag"], "--bogus-flag"),
    ("jaxllm.infer", ["--chat", "--raw-prompt"], "not allowed with"),
    ("jaxllm.infer", ["--prompt-file", "/nonexistent/prompt.txt"], "prompt-file"),
    ("jaxllm.infer", ["--model-dir", "/nonexistent/model"], "does not exist"),
    ("jaxllm.infer", ["--num-processes", "2"], "go together"),
    ("jaxllm.infer", ["--perplexity", "--ppl-file", "/nonexistent/text.txt"], "no such file"),
    ("jaxllm.infer", ["--perplexity", "--ppl-file", "README.md", "--ppl-window", "1"], "window"),
    ("jaxllm.bench", ["--shape", "no-such-model"], "unknown shape"),
    ("jaxllm.bench", ["--shape", "qwen3-0.6b", "--model-dir", "/m"], "not allowed with"),
    ("jaxllm.bench", ["--shape", "qwen3-0.6b", "--ctx", "0"], "--ctx"),
    ("jaxllm.bench", ["--shape", "qwen3-0.6b", "--top-p", "1.5"], "top_p"),
    ("jaxllm.bench", ["--model-dir", "/nonexistent/model"], "does not exist"),
    ("jaxllm.serve", ["--port", "99999"], "--port"),
    ("jaxllm.serve", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ("jaxllm.serve", ["--request-timeout", "-1"], "--request-timeout"),
    ("jaxllm.serve", ["--tokenizer", "/tmp"], "--shape"),
    ("jaxllm.serve", ["--shape", "no-such-model"], "unknown shape"),
    ("jaxllm.serve", ["--model-dir", "/nonexistent/model"], "does not exist"),
    ("jaxllm.convert", [], "--out"),
    ("jaxllm.convert", ["--out", "/tmp/x", "--tp", "0"], "--tp"),
    ("jaxllm.convert", ["--out", ROOT], "not empty"),
    ("jaxllm.convert", ["--out", "/tmp/x", "--model-dir", "/nonexistent/model"], "does not exist"),
])
def test_bad_flags_are_refused_before_jax_loads(module, flags, needle, tmp_path):
    r = front_end(module, *flags, cache=tmp_path / "cache")
    assert_one_line_error(r, needle)
    assert not jax_imported(r), r.stdout


@pytest.mark.parametrize("module,flags,needle", [
    ("jaxllm.infer", ["--raw-prompt", "--prompt", "The capital of France is", "--max-tokens", "10000000"],
     ["max_tokens 10000000", "max_ctx 8192"]),
    ("jaxllm.infer", ["--model-dir", "GOOD", "--max-ctx", "16", "--max-tokens", "16"], ["max_tokens 16", "max_ctx 16"]),
])
def test_limits_of_the_model_are_checked_before_any_weight_is_read(module, flags, needle, good, tmp_path):
    """New tokens that cannot fit the context (the embedded model's default of 8192, or --max-ctx)
    are refused from the model's config alone: its weights are never read, and nothing lands in
    the cache. (A context past the model's trained length is a warning in every front end:
    tests/kv/test_long_context.py.)"""
    flags = [str(good) if f == "GOOD" else f for f in flags]
    r = front_end(module, *flags, prelude=NO_WEIGHTS, cache=tmp_path / "cache")
    assert "a weight was read" not in r.stderr
    assert_one_line_error(r, *needle)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.slow
def test_prompt_longer_than_max_ctx():
    r = infer("--raw-prompt", "--prompt", "word " * 200, "--max-ctx", "64", "--max-tokens", "4")
    assert_one_line_error(r, "max_ctx", "64")
