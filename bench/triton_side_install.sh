#!/usr/bin/env bash
# Install the GPU machine's Triton beside this environment's, for the compile check under it.
#
#   eval "$(bench/triton_side_install.sh [DIR])"    # then: pytest tests/reliability/test_compile_check.py
#
# pip-installs triton==$TRITON_SIDE_VERSION (default 3.6.0, the lent H200's) and numpy<2.4 (its
# interpreter fails on numpy >= 2.4) into DIR (default ~/.cache/seq2seq_fast/triton-side, outside the tree) with --target, reusing
# DIR when it is already there, and prints `export SEQ2SEQ_FAST_TRITON_SIDE=DIR` for
# tests/reliability/test_compile_check.py, which then also compiles the kernels under that Triton. Never fails
# its caller: a failed or slow (> 3 min) download prints a note and exports nothing, and the test
# skips, so CI cannot fail because a download did.
set -uo pipefail
DIR="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/seq2seq_fast/triton-side}"
VERSION="${TRITON_SIDE_VERSION:-3.6.0}"
if ! PYTHONPATH="$DIR" python3 -c "import triton, sys; sys.exit(triton.__version__ != '$VERSION')" \
    > /dev/null 2>&1; then
  rm -rf "$DIR"
  if ! timeout 180 python3 -m pip install -q --no-deps --target "$DIR" "triton==$VERSION" \
      "numpy<2.4" > /dev/null 2>&1; then
    echo "echo 'note: triton $VERSION side install failed; its compile check will be skipped' >&2"
    rm -rf "$DIR"
    exit 0
  fi
fi
echo "export SEQ2SEQ_FAST_TRITON_SIDE=$(cd "$DIR" && pwd)"
