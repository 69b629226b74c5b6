"""The package's layout as a process meets it: the GPU backend (Pallas, Triton, `jaxllm.ops.gpu`) is
loaded only where `ops.select` picks it, so importing jaxllm, or running a model on the XLA
backend, loads none of it."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
# jax imports jaxlib's own Triton bindings (jaxlib.gpu_triton) itself, with or without Pallas
ALLOWED = {"jaxlib.gpu_triton"}


def gpu_modules(modules) -> list[str]:
    """Modules of the GPU backend: anything Pallas, the top-level triton package, jaxllm.ops.gpu."""
    return sorted(m for m in modules if m not in ALLOWED
                  and ("pallas" in m or m.split(".")[0] == "triton"
                       or m == "jaxllm.ops.gpu" or m.startswith("jaxllm.ops.gpu.")))


def loaded(code: str, *args) -> list[str]:
    """sys.modules after `code` ran in a fresh CPU process."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([ROOT, HERE])}
    r = subprocess.run([sys.executable, "-c", code + "\nprint(json.dumps(sorted(sys.modules)))", *args],
                       capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_filter_sees_the_gpu_backend():
    assert gpu_modules(["jax._src.pallas.core", "triton", "triton.language", "jaxllm.ops.gpu",
                        "jaxllm.ops.gpu.backend", "jaxlib.gpu_triton", "jaxllm.ops.xla", "jaxllm.ops",
                        "jaxllm.ops.gpux"]) == ["jax._src.pallas.core", "jaxllm.ops.gpu", "jaxllm.ops.gpu.backend",
                                                "triton", "triton.language"]


def test_importing_jaxllm_loads_no_kernels():
    mods = loaded("import json, jaxllm, sys\njaxllm.Engine")
    assert "jaxllm.engine.engine" in mods and "jax" in mods
    assert gpu_modules(mods) == []


def test_importing_jaxllm_or_its_front_ends_loads_no_jax():
    """The package and the command-line front ends check their flags before JAX loads: importing
    them imports none of it (`jaxllm.Engine` and `jaxllm.load` import the engine when used)."""
    mods = loaded("import json, sys\nimport jaxllm, jaxllm.infer, jaxllm.bench, jaxllm.convert, jaxllm.serve.__main__")
    front_ends = {"jaxllm.cli.infer", "jaxllm.benchmarks.bench", "jaxllm.cli.convert", "jaxllm.serve.__main__"}
    assert front_ends <= set(mods)
    assert not [m for m in mods if m == "jax" or m.startswith(("jax.", "jaxlib"))]


@pytest.mark.parametrize("kernels", ["xla", "auto"])
def test_a_model_on_the_xla_backend_loads_no_kernels(kernels, tmp_path):
    """A model loaded and run on XLA (kernels="xla", or "auto" on a CPU, XLA with the CPU's output
    head); "pallas" for contrast loads the backend."""
    import tiny
    tiny.make("gemma3", tmp_path / "m", seed=1)          # torch, here: not in the process looked at
    code = ("import json, sys\nimport jaxllm\n"
            "eng = jaxllm.load(sys.argv[1], quant='int8', dtype='float32', max_ctx=32,"
            " runtime=jaxllm.RuntimeConfig(kernels=sys.argv[2]))\n"
            "assert eng.ops.name == sys.argv[3], eng.ops\n"
            "assert 1 <= len(eng.generate_ids([[1, 2, 3]], max_tokens=3)[0].token_ids) <= 3")
    mods = loaded(code, str(tmp_path / "m"), kernels, {"xla": "xla", "auto": "cpu"}[kernels])
    assert "jaxllm.ops.xla" in mods and "jaxllm.engine.engine" in mods
    assert gpu_modules(mods) == []
    if kernels == "xla":
        mods = loaded(code, str(tmp_path / "m"), "pallas", "pallas")
        assert {"jaxllm.ops.gpu", "jaxllm.ops.gpu.backend"} <= set(gpu_modules(mods))


def test_import_layers_hold():
    """The import-linter contracts in pyproject.toml: the command lines and benches over serve over
    the engine over weights over model over kv over ops over the base, and the GPU kernels reached
    only through ops.select."""
    r = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                        "sys.exit(lint_imports_command())"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_no_module_imports_itself_through_others():
    """No import cycle, counting the imports inside functions."""
    import grimp
    g = grimp.build_graph("jaxllm")
    cycles = []
    for m in sorted(g.modules):
        for d in g.find_modules_directly_imported_by(m):
            chain = g.find_shortest_chain(importer=d, imported=m)
            if chain:
                cycles.append((m, *chain))
    assert cycles == []


def test_ruff_is_clean():
    """`ruff check` over everything and `ruff format --check` over the code (pyproject.toml keeps the
    tests' case tables out of the formatter)."""
    for args in (["check", "jaxllm", "tests", "scripts"], ["format", "--check", "jaxllm", "tests", "scripts"]):
        r = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_nothing_below_the_front_ends_reads_the_environment():
    """Settings are read from the environment once, at a front end (the command lines, the server's
    start, `jaxllm.load`), into `RuntimeConfig` and `Caches`: no module of the engine, the server's
    app, the weights, the model, the KV memory or the backends reads it."""
    import ast
    import pathlib
    below = ("engine", "serve", "weights", "model", "kv", "ops")
    readers = {"env", "set_default", "from_env", "cache_dir", "cache_home", "environ", "getenv"}
    found = []
    for part in below:
        for path in sorted(pathlib.Path(ROOT, "jaxllm", part).rglob("*.py")):
            if path.name == "__main__.py":     # the server's front end
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
                names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else [name]
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n in readers]
    assert found == []
