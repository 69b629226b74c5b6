"""What a checkpoint's config.json says of weights stored quantized (`quantization_config`): the
format the loader reads, every other refused by name before anything loads. No JAX here: the front
ends check a model directory with it before JAX loads."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.errors import ModelError

FP8_BLOCK = (128, 128)
# What quant_method names where it is not FP8 (transformers' spellings), for the refusal.
OTHER_METHODS = {
    "awq": "AWQ",
    "gptq": "GPTQ",
    "bitsandbytes": "bitsandbytes",
    "compressed-tensors": "compressed-tensors",
    "mxfp4": "MXFP4",
}


@dataclass(frozen=True)
class Fp8Blocks:
    """Transformers' fine-grained FP8 (as DeepSeek-V3 and Qwen's -FP8 checkpoints store it): each
    quantized linear weight float8_e4m3fn [out, in], beside a float32 `<name>_scale_inv`
    [ceil(out / block[0]), ceil(in / block[1])]; the weight is each value times its block's entry.
    Modules in `modules_to_not_convert` (the output head) are stored unquantized, without one."""

    block: tuple[int, int] = FP8_BLOCK


def stored_format(hf: dict, where: str = "config.json") -> Fp8Blocks | None:
    """The quantized format of a checkpoint's weights, from its top-level config.json (`where`;
    None: not quantized); one line naming what is not supported."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelError(f"{where}: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method != "fp8":
        name = OTHER_METHODS.get(method, repr(method))
        raise ModelError(
            f"{where}: {name} checkpoints (quant_method {method!r}) are not supported; "
            "FP8 ones (quant_method 'fp8', 128x128 blocks) and unquantized ones are"
        )
    block = qc.get("weight_block_size")
    if block is None:
        raise ModelError(f"{where}: per-tensor FP8 (no weight_block_size) is not supported; 128x128 blocks are")
    if not isinstance(block, (list, tuple)) or list(block) != list(FP8_BLOCK):
        raise ModelError(f"{where}: FP8 weight_block_size {block} is not supported; [128, 128] is")
    for key, want in (("fmt", "e4m3"), ("activation_scheme", "dynamic"), ("scale_fmt", "float")):
        got = qc.get(key, want)
        if str(got).lower() != want:
            raise ModelError(f"{where}: FP8 {key} {got!r} is not supported; {want!r} is")
    return Fp8Blocks(tuple(block))
