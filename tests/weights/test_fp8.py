"""FP8 checkpoints (transformers' fine-grained FP8, as Qwen's -FP8 checkpoints store their weights;
tests/helpers/to_fp8.py writes tiny Qwen3 and Gemma 3 ones): weights equal to the format's own
dequantization, logits of transformers run on those weights, int8 close to them, conversion to a
saved int8 directory, and the quantized formats that cannot load refused in one line."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tiny
import to_fp8
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

import jaxllm
from jaxllm.cli.convert import convert
from jaxllm.model.families import family_named
from jaxllm.quant import QuantArray, dequantize
from jaxllm.weights import locate
from jaxllm.weights.safetensors_source import SafetensorsSource

ROOT = Path(__file__).resolve().parents[2]
S, G = "sliding_attention", "full_attention"
# hidden 128 so that whole 128x128 blocks exist; Gemma 3's MLP width 320 ends in half blocks, its
# head_dim 64 puts two heads in a block of Q's rows; Qwen3-MoE's experts are stored one at a time
CASES = {
    "qwen3": ("qwen3", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "gemma3": ("gemma3", dict(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, layer_types=[S, G], final_logit_softcapping=30.0)),
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                    head_dim=32, moe_intermediate_size=64, tie_word_embeddings=False)),
}
IDS = np.random.default_rng(1).integers(0, 160, (2, 13)).astype(np.int32)


class Case:
    """A tiny FP8 checkpoint, its twin holding its weights dequantized in float32, transformers'
    logits of the twin, and engines on the checkpoint."""

    def __init__(self, name, d):
        family, over = CASES[name]
        self.dir = d / "fp8"
        held = to_fp8.write(tiny.make(family, self.dir, seed=len(name), **over), self.dir)
        self.twin = to_fp8.write_dequantized(held, self.dir, d / "twin")
        model = AutoModelForCausalLM.from_pretrained(self.twin, dtype=torch.float32).eval()
        self.ref = tiny.hf_logits(model, IDS)
        self._engines = {}

    def engine(self, quant, dtype="float32", kernels="auto"):
        key = quant, dtype, kernels
        if key not in self._engines:
            self._engines[key] = jaxllm.load(str(self.dir), quant=quant, dtype=dtype, max_ctx=32,
                                             runtime=jaxllm.RuntimeConfig(kernels=kernels))
        return self._engines[key]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def stored(d) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    src = SafetensorsSource(Path(d))
    return {n[: -len("_scale_inv")]: (src.get(n[: -len("_scale_inv")]), src.get(n))
            for n in src.names() if n.endswith("_scale_inv")}


def layer_weights_as_hf(eng, part=dequantize) -> dict[str, np.ndarray]:
    """`part` of each of the engine's layer matmul weights (default: its float32 values) under the
    HF names of a checkpoint that stores experts one at a time, [out, in]."""
    fam = family_named(eng.cfg.family)
    out = {}
    for g, group in fam.abstract(eng.cfg)["layers"].items():
        ids = [i for i in range(eng.cfg.num_layers) if eng.cfg.group_of(i) == g]
        for k, spec in group.items():
            if not spec.n_contract:
                continue
            w = np.asarray(part(eng.weights["layers"][g][k]))
            for j, i in enumerate(ids):
                experts = f"model.layers.{i}.mlp.experts"
                if k == "experts_gate_up":          # [E, D, 2, F]
                    for e, x in enumerate(w[j]):
                        out[f"{experts}.{e}.gate_proj.weight"], out[f"{experts}.{e}.up_proj.weight"] = x[:, 0].T, x[:, 1].T
                elif k == "experts_down":           # [E, F, D]
                    out.update({f"{experts}.{e}.down_proj.weight": x.T for e, x in enumerate(w[j])})
                else:
                    n_in = math.prod(w.shape[1:1 + spec.n_contract])
                    out["model." + fam.hf_name(k, i)] = w[j].reshape(n_in, -1).T
    return {n: np.ascontiguousarray(a) for n, a in out.items()}


def transformers_dequantized(q, s):
    """transformers' own dequantization (Fp8Dequantize, whole blocks only)."""
    t = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return Fp8Dequantize(None)._dequantize_one(t, torch.from_numpy(s), torch.float32).numpy()


def test_weights_equal_the_formats_dequantization(case):
    got = layer_weights_as_hf(case.engine("none"))
    fp8 = stored(case.dir)
    assert set(fp8) == set(got)               # every layer matmul weight, nothing else (lm_head stays bf16)
    whole = 0
    for name, (q, s) in fp8.items():
        assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32
        np.testing.assert_array_equal(got[name], to_fp8.dequantize(q, s), err_msg=name)
        if q.shape[0] % s.shape[0] == 0 and q.shape[1] % s.shape[1] == 0:
            np.testing.assert_array_equal(got[name], transformers_dequantized(q, s), err_msg=name)
            whole += 1
    assert whole >= len(fp8) // 2


def test_logits_match_transformers(case):
    assert tiny.rel_err(case.engine("none").logits(IDS), case.ref) < 1e-4


def test_int8_close_to_the_fp8_weights(case):
    eng = case.engine("int8")
    q = next(iter(eng.weights["layers"].values()))["q"]
    assert isinstance(q, QuantArray) and q.q.dtype == np.int8
    assert tiny.rel_err(eng.logits(IDS), case.ref) < 5e-2


def test_fp8_on_the_device_keeps_the_stored_values(case):
    """--quant fp8: the layers' matmul weights as the checkpoint stores them, each value with the
    scale of its block; the stacked experts quantized again from their values."""
    eng = case.engine("fp8")
    for group in eng.weights["layers"].values():
        for k, w in group.items():
            if k in ("q", "k", "v", "o", "gate", "up", "down", "experts_gate_up", "experts_down"):
                assert isinstance(w, QuantArray) and w.blockwise and w.q.dtype == ml_dtypes.float8_e4m3fn, k
    values, got = layer_weights_as_hf(eng, lambda w: w.q), layer_weights_as_hf(eng)
    for name, (q, s) in stored(case.dir).items():
        if to_fp8.EXPERT.fullmatch(name):
            assert tiny.rel_err(got[name], to_fp8.dequantize(q, s)) < 2 ** -4, name
        else:
            np.testing.assert_array_equal(values[name].view(np.uint8), q.view(np.uint8), err_msg=name)
            np.testing.assert_array_equal(got[name], to_fp8.dequantize(q, s), err_msg=name)


def test_fp8_on_the_device_computes_the_dequantized_weights(case):
    """Logits of --quant fp8 are those of --quant none, in float32 and in bfloat16: the matmuls
    scale each block's values as the dequantization does (the requantized experts: close)."""
    moe = bool(case.engine("fp8").cfg.moe)
    for dtype in ("float32", "bfloat16"):
        err = tiny.rel_err(case.engine("fp8", dtype).logits(IDS), case.engine("none", dtype).logits(IDS))
        assert err < (5e-2 if moe else 1e-6), (dtype, err)


def test_fp8_under_the_gpu_backend_takes_xla_matmuls(case):
    """The GPU backend's kernels take int8 or float weights: FP8 blocks go to XLA's matmuls (here the
    kernels run interpreted)."""
    eng = case.engine("fp8", kernels="pallas")
    assert eng.ops.name == "pallas"
    assert tiny.rel_err(eng.logits(IDS), case.engine("fp8").logits(IDS)) < 1e-5


def test_convert_keeps_fp8(case, tmp_path):
    out = convert(case.dir, tmp_path / "fp8", quant="fp8", dtype="float32")
    saved = jaxllm.load(str(out), quant="fp8", dtype="float32", max_ctx=32)
    np.testing.assert_array_equal(saved.logits(IDS), case.engine("fp8").logits(IDS))


def test_fp8_from_random_weights_and_a_bf16_checkpoint(tmp_path):
    """--quant fp8 of weights not stored so: quantized in blocks as made or loaded."""
    eng = jaxllm.load(shape="qwen3-4b", dtype="float32", quant="fp8", max_ctx=32,
                      shape_overrides=dict(num_hidden_layers=2, hidden_size=128, intermediate_size=384,
                                           num_attention_heads=2, num_key_value_heads=1, vocab_size=256))
    down = eng.weights["layers"]["global"]["down"]
    assert down.blockwise and down.q.shape == (2, 384, 128) and down.scale.shape == (2, 3, 1)
    assert np.all(np.isfinite(eng.logits(IDS)))
    _, over = CASES["gemma3"]
    model = tiny.make("gemma3", tmp_path, seed=5, **over)
    eng = jaxllm.load(str(tmp_path), quant="fp8", dtype="float32", max_ctx=32)
    assert eng.weights["layers"]["sliding"]["gate"].blockwise
    assert tiny.rel_err(eng.logits(IDS), tiny.hf_logits(model, IDS)) < 5e-2


def test_convert_to_int8(case, tmp_path):
    out = convert(case.dir, tmp_path / "int8", quant="int8", dtype="float32")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    saved = jaxllm.load(str(out), quant="int8", dtype="float32", max_ctx=32)
    np.testing.assert_array_equal(saved.logits(IDS), case.engine("int8").logits(IDS))


def test_fp8_tensor_without_its_scales_is_one_line(case, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(case.dir, d)
    src = SafetensorsSource(d)
    drop = sorted(n for n in src.names() if n.endswith("_scale_inv"))[0]
    tensors = {n: np.array(src.get(n)) for n in src.names() if n != drop}
    (d / "model.safetensors").unlink()
    save_file(tensors, str(d / "rewritten.safetensors"))      # a new name: the header read above is kept by path
    with pytest.raises(jaxllm.ModelError, match=re.escape(f"'{drop[:-10]}' is FP8 but the checkpoint has no")) as e:
        jaxllm.load(str(d), dtype="float32", max_ctx=32)
    assert "\n" not in str(e.value)


REFUSED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, "AWQ checkpoints"),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "GPTQ checkpoints"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes checkpoints"),
    "fp8-64x64": ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"FP8 weight_block_size \[64, 64\]"),
    "fp8-per-tensor": ({"quant_method": "fp8"}, "per-tensor FP8"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_unsupported_quantization_is_one_line(kind, tmp_path):
    """Refused as the model is located: before JAX loads in the command lines, before the mesh in
    jaxllm.load."""
    qc, says = REFUSED[kind]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": qc}))
    for call in (locate, lambda d: jaxllm.load(d, max_ctx=32)):
        with pytest.raises(jaxllm.ModelError, match=says) as e:
            call(str(tmp_path))
        assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_convert_cli_refuses_before_jax_loads(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": REFUSED["awq"][0]}))
    code = ("import sys\nfrom jaxllm.cli.convert import main\nrc = main(sys.argv[1:])\n"
            "print(rc, any(m == 'jax' or m.startswith('jax.') for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, "--model-dir", str(tmp_path / "m"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.split() == ["2", "False"], r.stderr
    assert r.stderr.strip().count("\n") == 0 and "AWQ checkpoints" in r.stderr


@pytest.mark.slow
def test_load_converts_one_tensor_at_a_time(tmp_path):
    """Peak host memory growth while loading an FP8 checkpoint as int8, beyond the loaded weights
    themselves (which the CPU backend keeps in host memory), stays below the checkpoint's own size
    (its mapped pages count in it): a bf16 copy of the layers' weights (as large as their FP8 bytes
    twice) or a float32 one would not fit beside them; one tensor is dequantized at a time."""
    to_fp8.write_qwen3(tmp_path / "m")
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "rss_run.py"), str(tmp_path / "m"), "int8"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"checkpoint {m['checkpoint_mb']:.0f} MB fp8 -> int8 weights {m['weights_mb']:.0f} MB; "
          f"peak RSS growth while loading {m['growth_mb']:.0f} MB; load {m['load_s']:.1f} s")
    assert m["growth_mb"] - m["weights_mb"] < m["checkpoint_mb"]
