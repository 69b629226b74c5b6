"""Every command line as a user meets it: its --help, the engine flags it shares with the others
(declared once, in `config.engine.FLAGS`), and the README's first command."""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.config.engine import FLAGS, FRONT

ROOT = Path(__file__).resolve().parents[2]
FRONT_ENDS = {
    ("jaxllm.infer",): ("model_dir", "max_ctx", "quant", "kv_quant", "tp", "dtype", "speculative", "kernels",
                        "scan_unroll", "widen_once", "compilation_cache"),
    ("jaxllm.serve",): ("model_dir", "shape", "tokenizer", "max_ctx", "quant", "tp", "block_size", "speculative",
                        "kernels", "compilation_cache"),
    ("jaxllm.bench",): ("model_dir", "shape", "quant", "tp", "draft_shape", "draft_always", "kernels"),
    ("jaxllm.bench", "--serve"): ("model_dir", "shape", "max_ctx", "quant", "block_size", "speculative"),
    ("jaxllm.convert",): ("model_dir", "quant", "dtype", "tp"),
    ("jaxllm.tools.tpu_compile",): ("shape", "tp", "dp", "max_ctx", "quant", "kv_quant"),
}


def run(*args, timeout=120):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("command", FRONT_ENDS, ids=" ".join)
def test_help_lists_the_shared_flags(command):
    r = run("-m", *command, "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    for name in FRONT_ENDS[command]:
        assert FLAGS[name].names[0] in r.stdout, (name, r.stdout)


def test_each_flag_is_declared_once():
    """No module declares an engine flag of its own (every spelling in FLAGS and FRONT is added by
    `config.engine.add_flags` alone), and no spelling is declared twice with two meanings."""
    spellings = {n for f in (*FLAGS.values(), *FRONT.values()) for n in f.names}
    found, declared = [], {}
    for path in (ROOT / "jaxllm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                names = {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
                found += [(str(path.relative_to(ROOT)), n) for n in names & spellings]
                for n in names - spellings:
                    declared.setdefault(n, []).append(str(path.relative_to(ROOT)))
    assert found == []
    assert {n: where for n, where in declared.items() if len(where) > 1} == {}


def test_the_readme_first_command_runs():
    """The README's first line, less its install, on the embedded model."""
    block = re.search(r"```bash\n(.*?)\n", (ROOT / "README.md").read_text()).group(1)
    install, command = block.split(" && ", 1)
    assert install == "pip install -e ."
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "jaxllm.infer"]
    r = run(*args[1:], timeout=600)
    assert r.returncode == 0, r.stderr
    assert "France" in r.stdout and "32 new tokens" in r.stderr, (r.stdout, r.stderr)
