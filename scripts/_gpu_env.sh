# Sourced by the gpu_*.sh scripts: run from the repository root, put jaxllm on the path, and
# install from wheels in .whl/ whatever Python packages this machine lacks.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"
missing=()
for mod in "$@"; do
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "installing from .whl/ (missing: ${missing[*]})" >&2
        "$PY" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl >&2
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "missing Python packages (${missing[*]}) and no .whl/ folder to install them from" >&2
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
