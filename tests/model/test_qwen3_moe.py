"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM (float32, tiny random models written by
`save_pretrained`): prefill and decode-step logits, greedy continuations against `generate`, int8
weights, the config mapping, and both ways a checkpoint may store the experts."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import tiny
import torch
from dequant import dequantized, logits_on
from safetensors.torch import load_file, save_file

import jaxllm
from jaxllm import ModelError
from jaxllm.config.model import MoeSpec
from jaxllm.model.families import family_for, qwen3
from jaxllm.quant import QuantArray

TOL = 1e-4
LENS = (13, 9)            # unequal, right-padded; longer than the sliding case's window (4)
CACHE = 32
NEW_TOKENS = 8

CASES = {
    # top-2 of 4 experts, renormalized (as the published configs)
    "2of4": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2),
    # top-1 of 8, the raw softmax probability as its weight; every layer sliding
    "1of8-sliding": dict(num_experts=8, num_experts_per_tok=1, norm_topk_prob=False, num_hidden_layers=2,
                         use_sliding_window=True, sliding_window=4),
    # top-3 of 8, not renormalized; layer 1 keeps a dense MLP among routed layers
    "3of8-mixed": dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, num_hidden_layers=4,
                       mlp_only_layers=[1]),
}


def hf_logits(model, row) -> np.ndarray:
    return tiny.hf_logits(model, np.asarray([row]))[0]


class Case:
    """A saved tiny HF model, its jaxllm engine, the prompts and HF's logits of each."""

    def __init__(self, name, tmp):
        self.dir = tmp / name
        self.model = tiny.make("qwen3_moe", self.dir, seed=len(name), **CASES[name])
        self.engine = jaxllm.load(self.dir, quant="none", dtype="float32", max_ctx=64)
        rng = np.random.default_rng(0)
        self.rows = [rng.integers(1, 160, n).tolist() for n in LENS]
        self.hf = [hf_logits(self.model, r) for r in self.rows]
        self.ids = np.zeros((len(LENS), max(LENS)), np.int32)
        for b, r in enumerate(self.rows):
            self.ids[b, :len(r)] = r


_CASES: dict[str, Case] = {}


def get_case(name, tmp_path_factory) -> Case:
    if name not in _CASES:
        _CASES[name] = Case(name, tmp_path_factory.mktemp("qwen3_moe"))
    return _CASES[name]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return get_case(request.param, tmp_path_factory)


def test_config_and_weights_follow_the_checkpoint(case):
    hf = case.model.config
    cfg = case.engine.cfg
    assert cfg.moe.num_experts == hf.num_experts and cfg.moe.top_k == hf.num_experts_per_tok
    assert cfg.moe.norm_topk == hf.norm_topk_prob
    dense = [i for i, layer in enumerate(case.model.model.layers) if not hasattr(layer.mlp, "experts")]
    assert list(cfg.moe.dense_layers) == dense
    routed = case.engine.weights["layers"][cfg.group_of(next(i for i in range(cfg.num_layers) if cfg.routed(i)))]
    assert routed["experts_gate_up"].shape == (cfg.num_layers - len(dense), hf.num_experts, 64, 2, 32)
    assert ("gate" in routed) is False


def test_prefill_logits_match_transformers(case):
    full = case.engine.logits(case.ids, lengths=list(LENS))
    for b, n in enumerate(LENS):
        err = tiny.rel_err(full[b, :n], case.hf[b])
        assert err < TOL, f"row {b}: relative error {err:.2e}"


def test_decode_steps_match_transformers(case):
    """One token a step through the decode path (few tokens: each gathers its experts' weights)."""
    stepper = case.engine.core(len(LENS), CACHE)
    for t in range(max(LENS)):
        logits = stepper.step_logits(case.ids[:, t], np.full(len(LENS), t))
        for b, n in enumerate(LENS):
            if t < n:
                err = tiny.rel_err(np.asarray(logits[b]), case.hf[b][t])
                assert err < TOL, f"row {b} position {t}: relative error {err:.2e}"


def test_greedy_continuations_equal_transformers_generate(case):
    out = case.engine.generate_ids(case.rows, max_tokens=NEW_TOKENS, temperature=0.0)
    for row, got in zip(case.rows, out):
        with torch.no_grad():
            ref = case.model.generate(torch.tensor([row]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                      top_k=None, top_p=None, pad_token_id=0)
        assert got.token_ids == ref[0, len(row):].tolist()


def test_int8_checkpoint_equals_its_dequantized_weights(tmp_path_factory):
    """int8 experts (per expert and output channel) compute what their float values do, near HF."""
    case = get_case("3of8-mixed", tmp_path_factory)
    eng = jaxllm.load(case.dir, quant="int8", dtype="float32", max_ctx=64)
    experts = eng.weights["layers"]["global"]["experts_down"]
    assert isinstance(experts, QuantArray) and experts.scale.shape == (3, 8, 64)
    assert not isinstance(eng.weights["layers"]["global"]["router"], QuantArray)
    assert isinstance(eng.weights["layers"]["global_dense"]["down"], QuantArray)
    got = eng.logits(case.ids, lengths=list(LENS))
    ref = logits_on(case.engine, dequantized(eng.cfg, qwen3, eng.weights), case.ids, list(LENS))
    for b, n in enumerate(LENS):
        assert tiny.rel_err(got[b, :n], ref[b, :n]) < TOL
        assert tiny.rel_err(got[b, :n], case.hf[b]) < 5e-2     # and quantization error is small


# -- config mapping ------------------------------------------------------------------------------
BASE_HF = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_attention_heads": 4, "hidden_size": 64,
           "intermediate_size": 96, "vocab_size": 160, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32}


def test_sparse_step_and_mlp_only_layers_pick_the_dense_layers():
    cfg = qwen3.config_from_hf({**BASE_HF, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe == MoeSpec(8, 2, 32, norm_topk=False, dense_layers=(0, 2, 3, 4))   # HF's default: no renorm
    assert cfg.layer_groups == ("global_dense", "global", "global_dense", "global_dense", "global_dense", "global")
    every = qwen3.config_from_hf({**BASE_HF, "num_local_experts": 8, "num_experts": None, "norm_topk_prob": True})
    assert every.moe == MoeSpec(8, 2, 32, norm_topk=True) and every.layer_groups == ()
    assert qwen3.config_from_hf({**BASE_HF, "mlp_only_layers": list(range(6))}).moe is None


def test_family_is_picked_by_model_type_or_architecture():
    assert family_for({"model_type": "qwen3_moe"}) is qwen3
    assert family_for({"architectures": ["Qwen3MoeForCausalLM"]}) is qwen3
    assert qwen3.config_from_hf({**BASE_HF, "model_type": "qwen3"}).moe is None    # a dense Qwen3 config


# -- how the experts are stored --------------------------------------------------------------------
def rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def fuse_experts(tensors, E=4):
    """The experts as transformers holds them in memory: [E, 2F, D] gate then up, and [E, D, F]."""
    for layer in range(2):
        pre = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{pre}.{e}.gate_proj.weight"), tensors.pop(f"{pre}.{e}.up_proj.weight")])
                   for e in range(E)]
        tensors[f"{pre}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{pre}.down_proj"] = torch.stack([tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])


def test_fused_expert_tensors_load_as_the_same_model(tmp_path, tmp_path_factory):
    case = get_case("2of4", tmp_path_factory)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in load_file(case.dir / "model.safetensors")
    rewrite(case.dir, tmp_path / "fused", fuse_experts)
    eng = jaxllm.load(tmp_path / "fused", quant="none", dtype="float32", max_ctx=64)
    for name, w in case.engine.weights["layers"]["global"].items():
        assert np.array_equal(eng.weights["layers"]["global"][name], w), name


def test_missing_expert_tensor_is_one_line(tmp_path, tmp_path_factory):
    case = get_case("2of4", tmp_path_factory)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    rewrite(case.dir, tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(ModelError) as e:
        jaxllm.load(tmp_path / "bad", quant="none", dtype="float32")
    assert str(e.value) == f"checkpoint is missing tensor '{name}'"
