"""Gemma 4 text family against transformers' Gemma4ForCausalLM (float32, tiny randomized models
shrunk from the 31B, 26B-A4B, E4B and E2B configs), plus decode, MoE routing and loading checks."""
from __future__ import annotations

import copy
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dequant import dequantized, logits_on
from gemma4_refs import VARIANTS, build, forced_router, hf_logits
from safetensors.torch import load_file, save_file

import jaxllm
from jaxllm import ModelError
from jaxllm.model.families import gemma4
from jaxllm.model.moe import moe_ffn, route
from jaxllm.quant import QuantArray, quantize_np

TOL = 1e-4
# Full-forward logits against transformers run in float64, the answer both float32 computations
# approximate: on the E2B-like model transformers' own float32 logits are 7e-5 (of the largest)
# from it and ours 9.2e-5, in opposite directions, so float32 against float32 can reach 1.6e-4.
# (transformers' grouped expert matmul has no float64: the MoE model is compared in float32.)
TOL_F64 = 1.5e-4
LENS = (13, 9)            # both longer than the sliding window (4); unequal, right-padded
CACHE = 32                # one cache length for stepping and for generate_ids: one compile each


def rel_err(got, ref):
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def prompt_rows(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in LENS]


class Case:
    """A saved tiny HF model, its jaxllm engine, HF logits per row and our full-forward logits."""

    def __init__(self, variant, tmp):
        self.variant = variant
        self.model = build(variant)
        self.dir = tmp / variant
        self.model.save_pretrained(self.dir)
        self.engine = jaxllm.load(self.dir, quant="none", dtype="float32", max_ctx=64)
        self.rows = prompt_rows()
        self.hf = [hf_logits(self.model, r) for r in self.rows]
        moe = getattr(self.model.config, "enable_moe_block", False)
        exact = None if moe else copy.deepcopy(self.model).double()
        self.hf64 = None if moe else [hf_logits(exact, r) for r in self.rows]
        ids = np.zeros((len(self.rows), max(LENS)), np.int32)
        for b, r in enumerate(self.rows):
            ids[b, :len(r)] = r
        self.ids = ids
        self.full = self.engine.logits(ids, lengths=list(LENS))


_CASES: dict[str, Case] = {}


def get_case(variant, tmp_path_factory) -> Case:
    if variant not in _CASES:
        _CASES[variant] = Case(variant, tmp_path_factory.mktemp("gemma4"))
    return _CASES[variant]


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    return get_case(request.param, tmp_path_factory)


def test_logits_match_transformers(case):
    for b, n in enumerate(LENS):
        if case.hf64 is None:
            err = rel_err(case.full[b, :n], case.hf[b])
            assert err < TOL, f"row {b}: relative error {err:.2e}"
            continue
        err = rel_err(case.full[b, :n], case.hf64[b])
        assert err < TOL_F64, f"row {b}: relative error {err:.2e} against transformers in float64"
        assert rel_err(case.full[b, :n], case.hf[b]) < 2 * TOL_F64          # and in float32


def test_stepwise_decode_matches_full_forward(case):
    eng = case.engine
    stepper = eng.core(len(LENS), CACHE)
    for t in range(max(LENS)):
        logits = stepper.step_logits(case.ids[:, t], np.full(len(LENS), t))
        for b, n in enumerate(LENS):
            if t < n:
                err = rel_err(np.asarray(logits[b]), case.full[b, t])
                assert err < TOL, f"row {b} position {t}: relative error {err:.2e}"


def step_greedy(eng, rows, max_new):
    """Greedy decoding one token per engine.step call, every row at the same position."""
    seqs = [list(r) for r in rows]
    new = [[] for _ in rows]
    done = [False] * len(rows)
    stepper = eng.core(len(rows), CACHE)
    t = 0
    while not all(done):
        toks = [s[t] if t < len(s) else 0 for s in seqs]
        logits = stepper.step_logits(np.asarray(toks), np.full(len(rows), t))
        for b, s in enumerate(seqs):
            if done[b] or t != len(s) - 1:
                continue
            tok = int(np.argmax(np.asarray(logits[b])))
            s.append(tok)
            new[b].append(tok)
            done[b] = tok in eng.cfg.eos_ids or len(new[b]) >= max_new
        t += 1
    return [[x for x in n if x not in eng.cfg.eos_ids] for n in new]


# The loop is the same for every variant; these two cover MoE, per-layer inputs and KV sharing.
@pytest.mark.parametrize("variant", ["26b-a4b", "e2b"])
def test_fused_loop_matches_python_stepping(variant, tmp_path_factory):
    case = get_case(variant, tmp_path_factory)
    out = case.engine.generate_ids(case.rows, max_tokens=6, temperature=0.0)
    assert [c.token_ids for c in out] == step_greedy(case.engine, case.rows, 6)


def test_int8_checkpoint_equals_its_dequantized_weights(tmp_path_factory):
    """int8 weights (experts per expert and output channel) compute what their float values do."""
    case = get_case("26b-a4b", tmp_path_factory)
    eng = jaxllm.load(case.dir, quant="int8", dtype="float32", max_ctx=64)
    experts = eng.weights["layers"]["sliding"]["experts_down"]
    assert isinstance(experts, QuantArray) and experts.scale.shape == (6, 8, 64)
    got = eng.logits(case.ids, lengths=list(LENS))
    ref = logits_on(case.engine, dequantized(eng.cfg, gemma4, eng.weights), case.ids, list(LENS))
    for b, n in enumerate(LENS):
        assert rel_err(got[b, :n], ref[b, :n]) < TOL
        assert rel_err(got[b, :1], case.hf[b][:1]) < 5e-2     # and quantization error is small


# -- MoE -----------------------------------------------------------------------------------------
def dense_moe_reference(x, top_i, top_w, gate_up, down):
    """Per token, per chosen expert, in numpy: no grouping, no sorting."""
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j, e in enumerate(top_i[n]):
            gu = np.einsum("d,dcf->cf", x[n], gate_up[e])
            g = gu[0]
            h = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * gu[1]
            out[n] += top_w[n, j] * (h @ down[e])
    return out


@pytest.mark.parametrize("n_tokens", [12, 2])     # grouped by expert (12*3 > 8) and gathered (2*3 <= 8)
def test_moe_matches_dense_reference_with_uneven_routing(n_tokens):
    rng = np.random.default_rng(1)
    N, D, F, E, k = n_tokens, 16, 8, 8, 3
    cfg = gemma4.config_from_hf({"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": D,
                                 "intermediate_size": 8, "vocab_size": 32, "enable_moe_block": True,
                                 "num_experts": E, "top_k_experts": k, "moe_intermediate_size": F})
    w = {"router": jnp.asarray(forced_router(E, D, rng)), "router_scale": jnp.ones(D),
         "expert_scale": jnp.asarray(rng.uniform(0.5, 1.5, E).astype(np.float32))}
    x = rng.standard_normal((N, D)).astype(np.float32)
    x[0] = np.abs(x[0]) * np.sign(np.asarray(w["router"])[0])        # token 0 picks experts 0-2
    top_i, top_w = route(cfg.moe, w, jnp.asarray(x), cfg.norm_eps)
    top_i, top_w = np.asarray(top_i), np.asarray(top_w)
    used = np.bincount(top_i.ravel(), minlength=E)
    assert used[3] == used[4] == 0 and sorted(top_i[0]) == [0, 1, 2], used
    if N > 2:
        assert used.max() >= 3, used          # several tokens share an expert
    gate_up = rng.standard_normal((E, D, 2, F)).astype(np.float32) * 0.3
    down = rng.standard_normal((E, F, D)).astype(np.float32) * 0.3
    moe = jax.jit(moe_ffn, static_argnames="act")
    ref = dense_moe_reference(x, top_i, top_w, gate_up, down)
    got = moe(jnp.asarray(x), jnp.asarray(top_i), jnp.asarray(top_w), jnp.asarray(gate_up),
              jnp.asarray(down), act="gelu_tanh")
    assert rel_err(np.asarray(got), ref) < 1e-5
    # int8: per expert, per output channel scales; compare with the dequantized weights
    qs = [quantize_np(a, 1, stack_dims=1) for a in (gate_up, down)]
    deq = [q.astype(np.float32) * np.expand_dims(s, 1) for q, s in qs]
    ref8 = dense_moe_reference(x, top_i, top_w, *deq)
    got8 = moe(jnp.asarray(x), jnp.asarray(top_i), jnp.asarray(top_w),
               QuantArray(jnp.asarray(qs[0][0]), jnp.asarray(qs[0][1]), 1),
               QuantArray(jnp.asarray(qs[1][0]), jnp.asarray(qs[1][1]), 1), act="gelu_tanh")
    assert rel_err(np.asarray(got8), ref8) < 1e-5


# -- loading refuses inconsistent checkpoints ------------------------------------------------------
def rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def refusal(path) -> str:
    with pytest.raises(ModelError) as e:
        jaxllm.load(path, quant="none", dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_refuses_wrong_global_k_proj_shape(tmp_path, tmp_path_factory):
    src = tmp_path_factory.mktemp("ref31") / "m"
    build("31b").save_pretrained(src)
    name = "model.layers.5.self_attn.k_proj.weight"            # a global layer: 1 KV head x 32
    rewrite(src, tmp_path / "bad", lambda t: t.__setitem__(name, torch.zeros(2 * 32, 64)))
    msg = refusal(tmp_path / "bad")
    assert name in msg and "(32, 64)" in msg


def test_refuses_missing_per_layer_input_tensor(tmp_path, tmp_path_factory):
    src = tmp_path_factory.mktemp("refe4") / "m"
    build("e4b").save_pretrained(src)
    name = "model.layers.2.per_layer_input_gate.weight"
    rewrite(src, tmp_path / "bad", lambda t: t.pop(name))
    assert name in refusal(tmp_path / "bad")


def test_refuses_kv_sharing_without_a_producer(tmp_path):
    hf = {"num_hidden_layers": 4, "num_attention_heads": 2, "hidden_size": 16, "intermediate_size": 8,
          "vocab_size": 32, "num_kv_shared_layers": 2,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"]}
    with pytest.raises(ModelError, match="no earlier global layer"):
        gemma4.config_from_hf(hf)


# -- checkpoint layouts and chat template ----------------------------------------------------------
def test_multimodal_checkpoint_loads_its_text_tower(tmp_path, tmp_path_factory):
    """Gemma4ForConditionalGeneration: config under text_config, tensors under model.language_model."""
    import json
    case = get_case("e2b", tmp_path_factory)
    text = json.loads((case.dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
         "vision_config": {"hidden_size": 8}, "eos_token_id": [1, 106]}))
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(case.dir / "model.safetensors").items()}
    tensors["model.vision_tower.patch_embedder.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    eng = jaxllm.load(tmp_path, quant="none", dtype="float32", max_ctx=64)
    assert eng.cfg.replace(eos_ids=()) == case.engine.cfg.replace(eos_ids=()), "text config differs"
    assert eng.cfg.eos_ids == (1, 106)
    same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), eng.weights, case.engine.weights)
    assert all(jax.tree_util.tree_leaves(same))


def same_engine_model(a, b) -> bool:
    same = jax.tree_util.tree_map(lambda x, y: bool(np.array_equal(x, y)), a.weights, b.weights)
    return a.cfg == b.cfg and all(jax.tree_util.tree_leaves(same))


def test_unified_text_model_loads_as_the_same_model(tmp_path, tmp_path_factory):
    """Gemma4UnifiedForCausalLM (the 12B's class) is Gemma 4 text without PLE and MoE."""
    from gemma4_refs import BASE
    from transformers import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig
    case = get_case("31b", tmp_path_factory)
    kw = {k: v for k, v in {**BASE, **VARIANTS["31b"]}.items() if k != "hidden_size_per_layer_input"}
    model = Gemma4UnifiedForCausalLM(Gemma4UnifiedTextConfig(**kw, architectures=["Gemma4UnifiedForCausalLM"]))
    model.load_state_dict(case.model.state_dict(), strict=True)
    model.config._attn_implementation = "eager"
    assert rel_err(hf_logits(model.eval(), case.rows[0]), case.hf[0]) < 1e-6
    model.save_pretrained(tmp_path)
    assert same_engine_model(jaxllm.load(tmp_path, quant="none", dtype="float32", max_ctx=64), case.engine)


def test_fallback_chat_template_uses_gemma4_turns():
    from jaxllm.tokenizer import Tokenizer
    tok = Tokenizer(None, chat_template=gemma4.CHAT_TEMPLATE, bos_token="<bos>")
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
                    "<|turn>model\nHello.<turn|>\n<|turn>user\nBye<turn|>\n<|turn>model\n")
