"""Tiny HF checkpoints stored as transformers' fine-grained FP8 (quant_method "fp8", as Qwen's -FP8
checkpoints are): every nn.Linear weight outside `modules_to_not_convert` float8_e4m3fn, quantized in
128x128 blocks, beside its float32 `weight_scale_inv` [ceil(out/128), ceil(in/128)] (each block's
amax / 448); every other tensor bfloat16."""
from __future__ import annotations

import json
import math
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


def write(model: torch.nn.Module, path: Path, block=(128, 128), skip=("lm_head",)) -> dict[str, torch.Tensor]:
    """`model` (float32) saved under `path` in the FP8 format; returns the float32 state dict the file
    holds (FP8 weights dequantized by the format's formula, the rest rounded to bfloat16), which
    transformers loads to run the checkpoint as stored."""
    model.save_pretrained(path)
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in skip}
    saved = set(_saved_names(path))                   # without the tied weights save_pretrained leaves out
    tensors, held = {}, {}
    for name, t in model.state_dict().items():
        if name not in saved:
            continue
        w = t.detach().float().numpy()
        if name in linear:
            q, s = quantize(w, block)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            held[name] = torch.from_numpy(dequantize(q, s, block))
        else:
            tensors[name] = w.astype(ml_dtypes.bfloat16)
            held[name] = torch.from_numpy(tensors[name].astype(np.float32))
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": list(skip)}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return held


def _saved_names(path: Path):
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as h:
            yield from h.keys()
