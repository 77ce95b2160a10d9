#!/usr/bin/env bash
# Sets up .venv in the repository with pinned versions and builds blujax into it (editable).
# Prefers Python 3.12 (jax 0.11.2); Python 3.11 gets jax 0.10.2. Override with PYTHON=...
# The CUDA kernels (blujax._cuda) are compiled where nvcc and a GPU are both found; BLUJAX_CUDA=ON
# or OFF forces. The build's log is .venv/blujax-build.log.
set -euo pipefail
cd "$(dirname "$0")/.."

# The first candidate that really runs (a pyenv shim may exist for a version not selected).
find_python() {
  local candidates=("${PYTHON:-}" python3.12)
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
  fi
  candidates+=(python3.11 python3)
  for p in "${candidates[@]}"; do
    [ -n "$p" ] || continue
    if "$p" -c 'import sys; assert sys.version_info[:2] in ((3, 12), (3, 11))' 2>/dev/null; then
      command -v "$p"
      return
    fi
  done
  echo "no working python3.12 or python3.11 found; set PYTHON=/path/to/python" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python)
  echo "creating .venv with $py ($("$py" --version))"
  "$py" -m venv .venv
fi
ver=$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
pins=requirements/py$ver.txt
[ -f "$pins" ] || { echo "Python $ver is not supported (use 3.12 or 3.11)" >&2; exit 1; }
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install -c "$pins" jax jaxlib numpy optax tiktoken tokenizers tqdm matplotlib \
  safetensors huggingface_hub pytest pytest-xdist nanobind scikit-build-core cmake ninja
# Built against the pinned jaxlib already in .venv (the FFI ABI only runs forward). Of the build's
# output only its own "blujax: ..." lines show (whether blujax._cuda is built, and why).
log=.venv/blujax-build.log
echo "building blujax (log in $log)"
if ! .venv/bin/python -m pip --disable-pip-version-check -v install --no-build-isolation \
    --no-deps -e . 2>&1 | tee "$log" | awk 'sub(/^ *-- blujax: /, "blujax: ") {print; fflush()}'
then
  tail -40 "$log" >&2
  exit 1
fi
.venv/bin/python -c "import blujax, jax; print('blujax ready: kernels', blujax.kernel_backends(), 'jax', jax.__version__)"
