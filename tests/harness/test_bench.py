"""The throughput sweep end to end on small shapes, and the roofline arithmetic against hand counts."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from jaxllm.benchmarks import bench, records
from jaxllm.benchmarks.roofline import (
    causal_pairs,
    flops_per_step,
    kv_bytes_per_step,
    nbytes,
    prefill_flops,
    weight_bytes_per_step,
)
from jaxllm.errors import ModelError
from jaxllm.model.presets import load_preset
from jaxllm.model.presets import names as preset_names
from jaxllm.quant import QuantArray
from jaxllm.weights.random import random_weights

TINY = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": True}


def shape_file(tmp_path, name="tiny", **over):
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps({**TINY, **over}))
    return str(p)


def abstract_weights(cfg, fam, quant):
    return jax.eval_shape(lambda: random_weights(fam.abstract(cfg), quant, "bfloat16"))


def test_bytes_and_flops_per_step_by_hand(tmp_path):
    D, F, H, K, hd, V, L = 64, 128, 4, 2, 16, 512, 2
    cfg, fam = load_preset(shape_file(tmp_path))
    # int8 matmul weights + f32 scale per output channel; bf16 norms
    int8 = D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F
    scales = 4 * (H * hd + 2 * K * hd + D + 2 * F + D)
    norms = 2 * (2 * D + 2 * hd)
    tied_embed = V * D + 4 * V                        # int8 rows and a float32 scale per row
    per_layer = int8 + scales + norms
    w = abstract_weights(cfg, fam, "int8")
    assert isinstance(w["layers"]["global"]["q"], QuantArray) and isinstance(w["embed"], QuantArray)
    assert weight_bytes_per_step(cfg, w, batch=1) == L * per_layer + tied_embed + 2 * D == 113408
    assert nbytes(w) == 113408
    # untied: the embedding is only gathered (batch rows, with their scales), the lm_head read whole
    cfg_u, fam_u = load_preset(shape_file(tmp_path, "untied", tie_word_embeddings=False))
    wu = abstract_weights(cfg_u, fam_u, "int8")
    lm_head = D * V + 4 * V
    assert weight_bytes_per_step(cfg_u, wu, batch=3) == L * per_layer + 3 * (D + 4) + 2 * D + lm_head
    # bf16 weights: every matmul weight 2 bytes, no scales
    wb = abstract_weights(cfg, fam, "none")
    assert weight_bytes_per_step(cfg, wb, batch=1) == L * (2 * int8 + norms) + 2 * V * D + 2 * D
    # KV: bf16 K and V over ctx for every layer
    assert kv_bytes_per_step(cfg, batch=2, ctx=32) == L * 2 * (2 * 32 * K * hd * 2) == 16384
    # FLOPs: 2 per MAC, matmuls + tied output projection + QK^T and PV over ctx
    macs = L * (D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F) + V * D
    attn = L * 2 * H * hd * 32
    assert flops_per_step(cfg, fam.abstract(cfg), batch=1, ctx=32) == 2 * (macs + attn) == 229376
    # a prefill of 10 tokens: the layers for each token, the output projection for the last one,
    # and attention over the 55 causal (query, key) pairs
    pre = 10 * (macs - V * D) + V * D + L * 2 * H * hd * 55
    assert prefill_flops(cfg, fam.abstract(cfg), batch=3, n=10) == 2 * 3 * pre


def test_causal_pairs_within_a_window():
    assert causal_pairs(10, None) == 55 == causal_pairs(10, 10) == causal_pairs(10, 64)
    assert causal_pairs(10, 4) == sum(min(t + 1, 4) for t in range(10)) == 34
    assert causal_pairs(1, None) == 1 and causal_pairs(0, 4) == 0


def test_k_eq_v_layers_read_one_tensor_only_where_keys_are_rebuilt():
    from kv_tiny_models import gemma4_31b
    cfg = gemma4_31b(16)
    glob = [cfg.attn[k] for k in cfg.layer_kinds if cfg.attn[k].k_eq_v]
    assert glob
    one = sum(a.num_kv_heads * a.head_dim * 100 for a in glob)       # batch 1, ctx 100, 1 byte each
    assert kv_bytes_per_step(cfg, 1, 100, 1, shared=False) - kv_bytes_per_step(cfg, 1, 100, 1) == one


def test_sliding_layers_read_only_their_window(tmp_path):
    p = tmp_path / "g3.json"
    p.write_text(json.dumps({"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 32,
                             "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 8,
                             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}))
    cfg, _ = load_preset(str(p))
    per_pos = 2 * 1 * 16 * 2                          # K and V, one kv head of 16, bf16
    assert kv_bytes_per_step(cfg, batch=1, ctx=100) == per_pos * (8 + 100 + 8)
    assert kv_bytes_per_step(cfg, batch=1, ctx=4) == per_pos * 12


def check_report(rep, batches, ctx):
    for key in ("device", "jax_version", "date", "git_commit", "model", "settings", "ceilings", "points"):
        assert key in rep
    assert rep["device"]["kind"] and rep["jax_version"] == jax.__version__
    assert rep["settings"]["xla_flags"] == os.environ.get("XLA_FLAGS", "")   # flags change the step
    c = rep["ceilings"]
    assert c["bandwidth_GBps"] > 0 and c["matmul_bf16_TFLOPs"] > 0
    assert c["bandwidth_method"] in c["bandwidth_by_method_GBps"]
    assert c["bandwidth_GBps"] == max(v for v in c["bandwidth_by_method_GBps"].values() if isinstance(v, float))
    assert [p["batch"] for p in rep["points"]] == batches
    for p in rep["points"]:
        assert p["skipped"] is None and p["ctx"] == ctx
        assert p["ms_per_step"] > 0 and p["compile_s"] > 0
        assert p["tok_s"] == pytest.approx(p["batch"] * 1e3 / p["ms_per_step"])
        assert p["bytes_per_step"] == p["weight_bytes_per_step"] + p["kv_bytes_per_step"]
        # the roofline is the byte count over the bandwidth measured in this same run
        assert p["roofline_ms"] == pytest.approx(p["bytes_per_step"] / (c["bandwidth_GBps"] * 1e9) * 1e3)
        assert p["roofline_fraction"] == pytest.approx(p["roofline_ms"] / p["ms_per_step"])
        assert p["compute_ms"] == pytest.approx(p["flops_per_step"] / (c["matmul_bf16_TFLOPs"] * 1e12) * 1e3)


def run_bench(argv, capsys):
    assert bench.main(argv) == 0
    return capsys.readouterr().out


def test_sweep_on_tiny_shape_writes_json_png_and_table(tmp_path, capsys):
    out = tmp_path / "r" / "tiny.json"
    text = run_bench(["--shape", shape_file(tmp_path), "--dtype", "bfloat16", "--batches", "1,2", "--ctx", "24",
                      "--steps", "3", "--repeats", "2", "--prompt-lens", "8", "--out", str(out), "--probe-mib", "8",
                      "--matmul-n", "128"], capsys)
    rep = json.loads(out.read_text())
    check_report(rep, [1, 2], 24)
    assert rep["model"]["weight_bytes"] == 113408 and rep["model"]["quant"] == "int8"
    for p in rep["points"]:
        if p["batch"] == 1:          # TTFT is timed for a single prompt, with the smallest batch
            assert set(p["ttft_ms"]) == {"8"} and p["ttft_ms"]["8"] > 0 and p["ttft_compile_s"]["8"] > 0
            # MFU: the prefill's FLOPs over its time, against the matmul rate measured in this run
            rate = rep["ceilings"]["matmul_bf16_TFLOPs"] * 1e12
            assert p["prefill_mfu"]["8"] == pytest.approx(p["prefill_flops"]["8"] / (p["ttft_ms"]["8"] / 1e3) / rate,
                                                          rel=1e-3)
            assert p["prefill_flops"]["8"] > 8 * p["flops_per_step"] / 2 > 0
        else:
            assert p["ttft_ms"] == {} and p["prefill_mfu"] == {}
        assert p["weight_bytes_per_step"] == 113408
        assert p["kv_bytes_per_step"] == p["batch"] * 2 * 2 * 24 * 2 * 16 * 2
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    lines = text.strip().splitlines()
    assert "TTFT@8 ms" in lines[-3] and "MFU@8" in lines[-3]
    assert lines[-2].split()[0] == "1" and lines[-2].split()[-1].endswith("%") and lines[-1].split()[0] == "2"
    assert lines[-4].endswith("; greedy")


def test_results_go_under_the_user_cache_and_progress_shows_from_the_start(tmp_path, capsys, monkeypatch):
    """Without --out the JSON and the plot land in a new file under the user's cache (the weight
    cache's root, $JAXLLM_CACHE here), named on stderr; progress lines come before JAX loads and
    at every stage."""
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--shape", shape_file(tmp_path), "--batches", "1,2", "--ctx", "24", "--steps", "1",
                       "--warmup", "0", "--repeats", "1", "--prompt-lens", "8", "--ttft-every-batch",
                       "--probe-mib", "8", "--matmul-n", "128"]) == 0
    err = capsys.readouterr().err.splitlines()
    (out,) = (tmp_path / "cache" / "bench").glob("tiny-*.json")
    assert f"wrote {out} and {out.with_suffix('.png')}" in err and out.with_suffix(".png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "tiny.json"]     # nothing in the working folder
    assert all(set(p["ttft_ms"]) == {"8"} for p in json.loads(out.read_text())["points"])
    notes = [line for line in err if line.startswith("bench: ")]
    assert notes[0] == "bench: tiny: loading JAX"
    assert any("model ready" in n for n in notes)
    assert any(n.startswith("bench: batch 2: ") and "ms/step" in n for n in notes)


def test_defaults_are_sized_for_the_platform():
    """--batches, --ctx and --steps left unset take a CPU's small sweep there, the recorded
    results' points on GPUs and TPUs; flags given stay."""
    a = bench.build_parser().parse_args(["--shape", "qwen3-4b", "--ctx", "2048"])
    records.size_for(a, "cpu")
    assert (a.batches, a.ctx, a.steps) == ([1, 8], 2048, 16)
    for platform in ("gpu", "tpu"):
        a = bench.build_parser().parse_args(["--shape", "qwen3-4b", "--batches", "4"])
        records.size_for(a, platform)
        assert (a.batches, a.ctx, a.steps) == ([4], 1024, 64)


def test_sweep_on_gemma3_270m_shape(tmp_path, capsys):
    out, png = tmp_path / "g.json", tmp_path / "g.png"
    text = run_bench(["--shape", "gemma3-270m", "--batches", "2", "--ctx", "16", "--steps", "2", "--warmup",
                      "0", "--repeats", "1", "--out", str(out), "--plot", str(png), "--probe-mib", "8",
                      "--matmul-n", "128", "--temperature", "0.8", "--top-p", "0.9"], capsys)
    rep = json.loads(out.read_text())
    check_report(rep, [2], 16)
    assert rep["settings"]["sampling"] == {"temperature": 0.8, "top_k": None, "top_p": 0.9}
    assert "sampled at temperature 0.8, top_p 0.9" in text
    m = rep["model"]
    assert (m["family"], m["num_layers"], m["hidden_size"], m["vocab_size"]) == ("gemma3", 18, 640, 262144)
    # the tied 262144 x 640 int8 embedding (with a scale per row), read whole as the output
    # projection, is most of the bytes
    assert rep["points"][0]["weight_bytes_per_step"] == m["weight_bytes"] > 262144 * (640 + 4)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_flags_are_one_line_errors(tmp_path, capsys):
    for argv, msg in [(["--shape", "no-such-model"], "unknown shape 'no-such-model'"),
                      (["--shape", str(tmp_path / "missing.json")], "no such file"),
                      (["--shape", shape_file(tmp_path), "--tp", "2"], "--tp 2"),
                      (["--shape", shape_file(tmp_path), "--ctx", "0"], "--ctx"),
                      (["--shape", shape_file(tmp_path), "--top-p", "1.5"], "'top_p' must be in (0, 1]"),
                      (["--shape", shape_file(tmp_path), "--temperature", "-1"], "'temperature' must be >= 0"),
                      (["--shape", shape_file(tmp_path), "--int8-rings"], "--int8-rings needs int8 global layers"),
                      (["--shape", shape_file(tmp_path), "--rebuild-keys"], "--rebuild-keys applies to global layers whose V is their K")]:
        assert bench.main(argv + ["--out", str(tmp_path / "x.json")]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("bench: ")]
        assert len(err) == 1 and err[0].startswith("error:") and msg in err[0]
    assert not (tmp_path / "x.json").exists()


def test_every_preset_resolves_or_names_its_architecture():
    names = preset_names()
    assert {"qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-32b", "gemma3-270m", "gemma4-31b"} <= set(names)
    for name in names:
        try:
            cfg, fam = load_preset(name)
        except ModelError as e:                      # a family this build does not include
            assert str(e).startswith(f"shape {name!r}: unsupported model architecture")
            continue
        assert cfg.num_layers == len(cfg.layer_kinds) and fam.abstract(cfg)
    cfg, _ = load_preset("qwen3-32b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.tie_embeddings) == (64, 5120, False)


def test_sweep_on_a_model_directory(tmp_path, capsys):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    out = tmp_path / "m.json"
    run_bench(["--model-dir", str(tmp_path / "m"), "--batches", "2", "--ctx", "8", "--steps", "2",
               "--quant", "none", "--dtype", "bfloat16", "--out", str(out), "--probe-mib", "8", "--matmul-n", "128"],
              capsys)
    rep = json.loads(out.read_text())
    check_report(rep, [2], 8)
    p = rep["points"][0]
    # untied bf16: the 256 x 32 embedding is only gathered (2 rows), the lm_head is read whole
    assert p["weight_bytes_per_step"] == rep["model"]["weight_bytes"] - 256 * 32 * 2 + 2 * 32 * 2
    assert rep["model"]["model_dir"] == str(tmp_path / "m")


def test_bench_rows_hold_their_own_blocks():
    """The bench's filled cache: random K/V in blocks each row holds alone, a sliding kind's table
    as wide as its window and a global kind's as the context, so that every step reads ctx
    positions of global KV and a window of sliding KV per row, as a served request's would."""
    from jaxllm.benchmarks.sweep import decode_state
    from jaxllm.engine.engine import Engine
    from jaxllm.engine.sampling import SamplingParams
    from jaxllm.model.presets import load_preset
    cfg, fam = load_preset("gemma3-270m")
    ctx = 700
    eng = Engine(cfg, None, None, dtype="float32", max_ctx=ctx + 4, kv_quant="int8")
    state = decode_state(eng, 2, ctx, 4, 0, SamplingParams.make(2))
    tables = {n: np.asarray(t) for n, t in state.cache.tables.items()}
    P = eng.kv_options.block_size
    assert tables["global"].shape == (2, -(-(ctx + 4) // P))
    assert tables["sliding"].shape == (2, -(-(cfg.attn[0].window - 1 + 1) // P) + 1)
    blocks = np.concatenate([t.ravel() for t in tables.values()])
    assert 0 not in blocks and all(len(set(t.ravel())) == t.size for t in tables.values())
    assert np.asarray(state.slots.pos).tolist() == [ctx, ctx]


def test_serving_bench_on_a_tiny_shape(tmp_path):
    """`--serve` starts a server on random weights, drives it with concurrent streaming clients and
    reports every request's tokens, beside the fused loop at the same batch; a long prompt sent
    once every client streams is served beside them. With log-probabilities asked, the same requests
    run again without them, for the same tokens. The clients hold conversations of two turns after
    a shared prefix: the second turn's prompts come mostly from the prefix cache."""
    out = tmp_path / "serve.json"
    assert bench.main(["--serve", "--shape", shape_file(tmp_path), "--concurrency", "3", "--rounds", "2",
                       "--prompt-len", "4:12", "--output-len", "6", "--compilation-cache", "off",
                       "--long-prompt", "90", "--long-output", "3", "--logprobs", "2", "--shared-prefix", "20",
                       "--turns", "2", "--block-size", "16", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in rep["levels"]] == [3]
    for lv in rep["levels"]:
        assert lv["failed"] == 0 and lv["requests"] == 2 * lv["concurrency"]
        assert lv["output_tokens"] == 6 * lv["requests"] and lv["fused_tok_s"] > 0
        assert lv["ttft_ms"]["p50"] > 0 and 0 < lv["ratio"]
        # the bound: the loop's steps and one forward of the level's prompts a round, in the server's
        # pieces (a prompt of the mean length, 8, takes a piece of 128) and packed to their length
        loop = {p["batch"]: p for p in rep["fused_loop"]["points"]}[lv["concurrency"]]
        step, piece = loop["ms_per_step"], rep["settings"]["prefill_piece"]
        assert piece == 128
        assert lv["bound"] == pytest.approx(6 * step / (loop["ttft_ms"]["128"] + 5 * step)) and lv["bound"] > 0
        assert lv["bound_packed"] == pytest.approx(6 * step / (loop["ttft_ms"]["8"] + 5 * step))
        lp = lv["long_prompt"]
        assert lp["tokens"] == 3 and lp["ttft_ms"] > 0 and lp["prompt_tokens"] == 90
        plain = lv["plain"]
        assert plain["output_tokens"] == lv["output_tokens"] and plain["failed"] == 0
        first, second = lv["turns"]
        assert second["prompt_tokens"] > first["prompt_tokens"] and second["hit_rate"] > 0.5, lv["turns"]
        assert plain["of_plain"] == lv["output_tok_s"] / plain["output_tok_s"]
    assert rep["ready_s"] > 0 and rep["settings"]["max_num_seqs"] == 4
