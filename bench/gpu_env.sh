# Sourced by gpu_smoke.sh and gpu_measure.sh: sets PY (the Python to run) and exits 0 on a machine without CUDA.
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "no CUDA device: skipped"
  exit 0
fi
# A machine without network whose Python has torch but lacks a package (torchao, say): wheels fetched beforehand
# into .whl/ on a machine with pip (bench/README.md, "The GPU smoke test on a machine without network") are unpacked
# into a temporary folder for this run only (a wheel is a zip of its installed files).
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c 'import torchao' 2>/dev/null; then
  SITE=$(mktemp -d)
  for wheel in .whl/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE"; done
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
