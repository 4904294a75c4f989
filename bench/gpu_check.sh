#!/usr/bin/env bash
# One prepared GPU check of the Triton kernels (probes, gated benchmark rows, sweep, tests, targets).
#
#   bench/gpu_check.sh              on a machine with a CUDA GPU (e.g. a lent H200), one call
#   bench/gpu_check.sh --dry-run    same stages on tiny shapes, CPU, Triton interpreter
#
# Needs only python3 with torch and triton (pytest optional): nothing is installed. The package is
# imported from a temporary copy of the sources in which seq2seq_fast/_triton links to
# triton_kernels/, the view that `pip install -e .` gives (setup.py package_dir); the C++ extension
# is not needed. Output is teed into $OUT/gpu_check.log (with gpu_check.json and the summary) when
# OUT is set, rewritten after every row. Extra arguments go to bench/gpu_check.py (--budget-s,
# --shapes, --max-rows, --skip-tests, --no-sweep, --inject-failure).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

mkdir -p "$WORK/src"
cp -r "$REPO/seq2seq_fast" "$REPO/triton_kernels" "$REPO/tests" "$REPO/bench" "$REPO/pyproject.toml" "$WORK/src/"
# A _C built here against another torch would fail to load there; the Triton path does not need it.
find "$WORK/src" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
ln -s ../triton_kernels "$WORK/src/seq2seq_fast/_triton"

cd "$WORK/src"
export PYTHONPATH="$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
PYTHON="${PYTHON:-python3}"

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  "$PYTHON" bench/gpu_check.py --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
else
  "$PYTHON" bench/gpu_check.py "$@"
fi
