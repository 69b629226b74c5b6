"""The matmul kernels' tile tables (`ops.gpu.matmul_tiles`), on the CPU: known choices for each GPU
kind and shape class, the tables' shape, the candidates the tuning bench times, and the bench's
`--tune` run on a tiny shape with the kernels interpreted."""
import json
import os
import subprocess
import sys

from jaxllm.ops.gpu import matmul
from jaxllm.ops.gpu.matmul import choose_tiles
from jaxllm.ops.gpu.matmul_tiles import DEFAULT, TABLES, Entry, candidates, shape_class, table_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = {"H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200", "GH200": "NVIDIA GH200 480GB",
         "A100": "NVIDIA A100-SXM4-80GB"}

# device kind, M, K, N, keywords -> bm, bn, bk, split, warps, stages, fold, weights_first
CASES = [
    ("H100", 1, 2560, 6144, {}, (1, 64, 32, 8, 8, 3, 0, False)),
    ("H100", 1, 2560, 9728, {"gated": True}, (1, 128, 32, 4, 8, 3, 0, False)),
    ("H100", 1, 2560, 6144, {"out_major": True, "outputs": 3}, (1, 16, 512, 1, 8, 3, 16, False)),
    ("H100", 1, 2560, 6144, {"out_major": True}, (1, 16, 512, 2, 8, 3, 16, False)),
    ("H100", 1, 9728, 2560, {"out_major": True}, (1, 16, 512, 4, 8, 3, 16, False)),
    ("H100", 1, 5376, 5376, {"out_major": True, "psum_after": True}, (1, 8, 512, 1, 8, 3, 16, False)),
    ("H100", 1, 2560, 1024, {"out_major": True, "psum_after": True}, (1, 16, 512, 4, 8, 3, 16, False)),
    ("H100", 1, 9728, 2560, {"out_major": True, "psum_after": True, "outputs": 3}, (1, 16, 512, 4, 8, 3, 16, False)),
    ("H100", 1, 2560, 9728, {"gated": True, "out_major": True}, (1, 16, 512, 1, 8, 3, 16, False)),
    ("H100", 1, 70, 45, {"out_major": True}, (1, 16, 128, 1, 8, 3, 16, False)),
    ("H100", 8, 2560, 6144, {"out_major": True, "outputs": 3}, (16, 64, 128, 4, 4, 3, 0, False)),
    ("H100", 8, 9728, 2560, {"out_major": True}, (16, 32, 128, 4, 4, 3, 0, False)),
    ("H100", 8, 2560, 9728, {"gated": True, "out_major": True}, (16, 32, 128, 1, 4, 3, 0, False)),
    ("H100", 8, 2560, 9728, {"gated": True}, (16, 128, 128, 1, 8, 3, 0, False)),
    ("H100", 8, 2560, 6144, {}, (16, 128, 128, 4, 8, 3, 0, False)),
    ("H100", 24, 2560, 9728, {"gated": True, "out_major": True}, (32, 64, 128, 1, 4, 3, 0, False)),
    ("H100", 32, 2560, 2560, {"out_major": True}, (32, 64, 128, 4, 4, 3, 0, False)),
    ("H100", 24, 2560, 9728, {"gated": True}, (32, 128, 128, 4, 8, 3, 0, False)),
    ("H100", 64, 2560, 2560, {"out_major": True}, (64, 128, 128, 4, 8, 3, 0, False)),
    ("H100", 48, 5376, 10752, {"gated": True, "out_major": True}, (32, 64, 128, 1, 4, 3, 0, False)),
    ("H100", 100, 2560, 2560, {"out_major": True}, (64, 128, 128, 2, 8, 3, 0, False)),
    ("H100", 128, 5376, 21504, {"gated": True, "out_major": True}, (32, 64, 128, 1, 4, 3, 0, False)),
    ("H100", 128, 2560, 6144, {"out_major": True}, (64, 128, 128, 2, 8, 3, 0, False)),
    ("H100", 256, 2560, 6144, {"out_major": True}, (128, 64, 64, 2, 4, 3, 0, True)),
    ("H100", 256, 2560, 9728, {"gated": True, "out_major": True}, (128, 64, 64, 1, 4, 3, 0, True)),
    ("H100", 256, 2560, 6144, {}, (64, 128, 128, 2, 8, 3, 0, False)),
    ("H100", 512, 9728, 2560, {"out_major": True, "w_bytes": 2}, (128, 64, 64, 2, 4, 3, 0, True)),
    ("H100", 64, 2560, 9728, {"gated": True, "w_bytes": 2}, (64, 128, 128, 4, 8, 2, 0, False)),
    ("H200", 1, 5376, 10752, {"gated": True, "out_major": True}, (1, 16, 512, 1, 4, 3, 16, False)),
    ("H200", 1, 5376, 10752, {"out_major": True}, (1, 16, 512, 1, 8, 3, 16, False)),
    ("H200", 64, 2560, 2560, {"out_major": True}, (64, 128, 128, 4, 4, 3, 0, False)),
    ("H200", 100, 2560, 2560, {"out_major": True}, (64, 128, 128, 2, 4, 3, 0, False)),
    ("H200", 100, 5376, 21504, {"gated": True, "out_major": True}, (32, 64, 128, 1, 4, 3, 0, False)),
    ("H200", 128, 5376, 21504, {"gated": True, "out_major": True}, (128, 128, 64, 2, 8, 3, 0, False)),
    ("H200", 128, 5376, 5376, {"out_major": True}, (64, 128, 128, 2, 4, 3, 0, False)),
    ("H200", 128, 2560, 21504, {"out_major": True}, (128, 128, 64, 2, 8, 3, 0, False)),
    ("H200", 128, 2560, 6144, {}, (64, 128, 128, 2, 8, 3, 0, False)),
    ("H200", 32, 2560, 2560, {"out_major": True}, (32, 64, 128, 4, 4, 3, 0, False)),
    ("A100", 1, 5376, 10752, {"gated": True, "out_major": True}, (1, 16, 512, 1, 8, 3, 16, False)),
    ("A100", 128, 5376, 21504, {"gated": True, "out_major": True}, (32, 64, 128, 1, 4, 3, 0, False)),
    ("GH200", 1, 5376, 10752, {"gated": True, "out_major": True}, (1, 16, 512, 1, 4, 3, 16, False)),
    ("H100", 1, 2560, 6144, {"out_major": True, "bn": 64, "bk": 128, "warps": 4}, (1, 64, 128, 8, 4, 3, 16, False)),
    ("H100", 1, 5376, 5376, {"out_major": True, "psum_after": True, "bn": 16}, (1, 16, 512, 2, 8, 3, 16, False)),
    ("H100", 1, 2560, 1024, {"out_major": True, "psum_after": True, "bn": 8}, (1, 8, 512, 1, 8, 3, 16, False)),
    ("H100", 8, 2560, 6144, {"out_major": True, "bn": 128, "bk": 64, "warps": 8}, (16, 128, 64, 4, 8, 3, 0, False)),
]


def test_tables_give_the_known_tiles(monkeypatch):
    """Representative shapes of every class on each GPU kind (another GPU takes the H100's, a
    GH200 the H200's), with and without tiles given, to the tiles measured for them."""
    wrong = []
    for kind, M, K, N, kw, want in CASES:
        monkeypatch.setattr(matmul, "device_kind", lambda kind=KINDS[kind]: kind)
        t = choose_tiles(M, K, N, **kw)
        got = (t.bm, t.bn, t.bk, t.split, t.warps, t.stages, t.fold, t.weights_first)
        if got != want or t.out_major != kw.get("out_major", False):
            wrong.append((kind, M, K, N, kw, got, want))
    assert not wrong, wrong


def test_tables_cover_every_shape():
    """Each table has a class for any number of rows of each layout and gating, each class's last
    alternative is taken unconditionally, and an entry reads back as the tables write it."""
    assert table_for("NVIDIA GH200 480GB") is TABLES["H200"] and table_for("NVIDIA A100-SXM4-80GB") is DEFAULT
    for table in TABLES.values():
        for (rows, out_major, gated), entry in table.items():
            assert (None, out_major, gated) in table
            alternatives = entry if isinstance(entry, tuple) else (entry,)
            assert alternatives[-1].cover == 0
            for e in alternatives:
                assert eval(repr(e), {"Entry": Entry}) == e
    h200 = TABLES["H200"]
    assert [shape_class(h200, M, True, False)[0] for M in (1, 2, 16, 17, 64, 65, 127, 128, 129)] == \
        [1, 16, 16, 32, 64, 127, 127, 128, None]
    assert [shape_class(DEFAULT, M, True, False)[0] for M in (65, 128, 129)] == [128, 128, None]
    assert [shape_class(DEFAULT, M, False, True)[0] for M in (64, 65, 1000)] == [64, None, None]


def test_candidates_are_the_entry_and_its_neighbours():
    vector = Entry(1, 16, 512, 8, max_split=16, fill=3, whole=2, narrow=8)
    got = candidates(vector, 1, True)
    assert got[0] == vector and len(set(got)) == len(got)
    assert {(e.bn, e.bk, e.warps, e.max_split) for e in got[1:]} == {
        (8, 512, 8, 16), (32, 512, 8, 16), (16, 256, 8, 16), (16, 1024, 8, 16), (16, 512, 8, 8), (16, 512, 4, 16)}
    assert all(e.fill == 3 and e.whole == 2 and e.narrow == 8 and e.bm == 1 for e in got)
    rows16 = Entry(16, 64, 128, 4, max_split=4, cover=2)                # an alternative: timed as a plain entry
    got = candidates(rows16, 8, True)
    assert got[0] == Entry(16, 64, 128, 4, max_split=4) and all(e.cover == 0 for e in got)
    assert {e.bm for e in got} == {16}                                  # 8 rows: no taller tiles
    assert {e.bn for e in got} == {32, 64, 128} and {e.bk for e in got} == {64, 128, 256}
    assert Entry(16, 64, 128, 4, max_split=4, weights_first=True) in got
    assert {e.bm for e in candidates(Entry(64, 128, 128, 8, max_split=2), 100, False)} == {32, 64, 128}
    assert not any(e.weights_first for e in candidates(Entry(64, 128, 128, 8, max_split=2), 100, False))


def test_kernel_bench_tunes_a_tiny_shape(tmp_path):
    """`scripts/kernel_bench.py --tune` on the CPU, the kernels interpreted: a tiny Qwen3 shape's O
    projection at one row, two candidates; it prints the class's entry in the table's format."""
    config = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kernel_bench.py"), "--tune",
                        "--shape", str(tmp_path / "config.json"), "--rows", "1", "--layouts", "out", "--cases", "o",
                        "--rounds", "1", "--reps", "1", "--tune-passes", "1", "--tune-candidates", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("    (1, True, False): Entry("))
    assert eval(line.split(": ", 1)[1].split(",  #")[0], {"Entry": Entry}).bm == 1
    got = json.load(open(tmp_path / "kernel_tune.json"))["classes"]
    assert [c["class"] for c in got] == [[1, True, False]] and len(got[0]["tried_us"]) == 2
