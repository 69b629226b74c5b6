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


@pytest.mark.parametrize("flags,needle", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-tokens", "-3"], "max_tokens"),
    (["--temperature", "-0.5"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-1"], "top_k"),
    (["--max-ctx", "0"], "--max-ctx"),
    (["--bogus-flag"], "--bogus-flag"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "prompt-file"),
])
def test_bad_flags(flags, needle):
    assert_one_line_error(infer(*flags), needle)


@pytest.mark.slow
def test_prompt_longer_than_max_ctx():
    r = infer("--raw-prompt", "--prompt", "word " * 200, "--max-ctx", "64", "--max-tokens", "4")
    assert_one_line_error(r, "max_ctx", "64")


def test_max_tokens_beyond_the_context():
    """A prompt and --max-tokens that need more positions than the context (the embedded model's
    default of 8192) are refused with both numbers, not run until killed."""
    r = infer("--raw-prompt", "--prompt", "The capital of France is", "--max-tokens", "10000000")
    assert_one_line_error(r, "max_tokens 10000000", "max_ctx 8192")
