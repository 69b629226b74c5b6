"""Tiny HF checkpoints stored as transformers' fine-grained FP8 (quant_method "fp8", as Qwen's -FP8
checkpoints are): every nn.Linear weight outside `modules_to_not_convert` float8_e4m3fn, quantized in
128x128 blocks, beside its float32 `weight_scale_inv` [ceil(out/128), ceil(in/128)] (each block's
amax / 448); every other tensor bfloat16."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

F8 = ml_dtypes.float8_e4m3fn
F8_MAX = 448.0


def quantize(w: np.ndarray, block=(128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/b0), ceil(in/b1)])."""
    (O, I), (bo, bi) = w.shape, block
    go, gi = math.ceil(O / bo), math.ceil(I / bi)
    padded = np.zeros((go * bo, gi * bi), np.float32)
    padded[:O, :I] = w
    amax = np.abs(padded.reshape(go, bo, gi, bi)).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / F8_MAX, 1.0).astype(np.float32)
    q = padded.reshape(go, bo, gi, bi) / scale_inv[:, None, :, None]
    return np.clip(q, -F8_MAX, F8_MAX).reshape(go * bo, gi * bi)[:O, :I].astype(F8), scale_inv


def dequantize(q: np.ndarray, scale_inv: np.ndarray, block=(128, 128)) -> np.ndarray:
    """The format's formula: w[o, i] = q[o, i] * scale_inv[o // b0, i // b1]."""
    s = np.repeat(np.repeat(scale_inv, block[0], axis=0), block[1], axis=1)
    return q.astype(np.float32) * s[: q.shape[0], : q.shape[1]]


EXPERT = re.compile(r".*\.experts\.\d+\.(gate|up|down)_proj\.weight")   # stored one expert at a time


def write(model: torch.nn.Module, path: Path, block=(128, 128), skip=("lm_head",)) -> dict[str, np.ndarray]:
    """`model` (float32) saved under `path` in the FP8 format: the weights of its nn.Linear modules
    and of its experts quantized; returns the float32 tensors the file holds, by name (FP8 weights
    dequantized by the format's formula, the rest rounded to bfloat16)."""
    model.save_pretrained(path)
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in skip}
    tensors, held = {}, {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as h:
            saved = {n: h.get_tensor(n).astype(np.float32) for n in h.keys()}
        f.unlink()
        for name, w in saved.items():
            if name in linear or EXPERT.fullmatch(name):
                q, s = quantize(w, block)
                tensors[name], tensors[name + "_scale_inv"] = q, s
                held[name] = dequantize(q, s, block)
            else:
                tensors[name] = w.astype(ml_dtypes.bfloat16)
                held[name] = tensors[name].astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": list(skip)}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return held


def write_dequantized(held: dict[str, np.ndarray], fp8_dir: Path, path: Path) -> Path:
    """The FP8 checkpoint's twin: the same config, unquantized, its tensors `held` in float32."""
    path.mkdir(parents=True)
    cfg = json.loads((fp8_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(held, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_qwen3(path: Path, layers=8, hidden=1024, inter=3072, vocab=32000, heads=16, kv=8, hd=64) -> None:
    """A few-hundred-MB FP8 Qwen3 checkpoint written tensor by tensor (no model is built): the
    projections FP8, the embedding, output head and norms bfloat16."""
    path.mkdir()
    cfg = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
               intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
               head_dim=hd, tie_word_embeddings=False, max_position_embeddings=4096,
               quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]})
    (path / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    r = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02)
    t = {"model.embed_tokens.weight": r(vocab, hidden), "lm_head.weight": r(vocab, hidden), "model.norm.weight": r(hidden)}
    t = {n: a.astype(ml_dtypes.bfloat16) for n, a in t.items()}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + n + ".weight"] = r(hidden).astype(ml_dtypes.bfloat16)
        for n in ("q_norm", "k_norm"):
            t[p + "self_attn." + n + ".weight"] = r(hd).astype(ml_dtypes.bfloat16)
        for n, shape in (("self_attn.q_proj", (heads * hd, hidden)), ("self_attn.k_proj", (kv * hd, hidden)),
                         ("self_attn.v_proj", (kv * hd, hidden)), ("self_attn.o_proj", (hidden, heads * hd)),
                         ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                         ("mlp.down_proj", (hidden, inter))):
            t[p + n + ".weight"], t[p + n + ".weight_scale_inv"] = quantize(r(*shape))
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
