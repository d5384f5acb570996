#!/usr/bin/env bash
# The torch-internals subset of the suite (`pytest -m compat`) on a given torch release, in a fresh venv.
#
#   tests/compat_run.sh 2.15.0            # venv in a new temporary folder, removed afterwards
#   tests/compat_run.sh 2.14.1 /tmp/venv  # venv kept at /tmp/venv (reused if it holds that release)
#
# pip runs with the caller's configuration: where a pip configuration caps torch below the release
# asked for, lift it for this command (e.g. PIP_CONFIG_FILE=/dev/null). Extra pytest arguments go
# in PYTEST_ARGS (default "-n 2 -q").
set -euo pipefail
release=${1:?usage: tests/compat_run.sh TORCH_RELEASE [VENV_DIR]}
cd "$(dirname "$0")/.."
if [ -n "${2:-}" ]; then
  venv=$2
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  venv=$tmp/venv
fi
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$release')" 2>/dev/null; then
  python -m venv "$venv"
  # torch first, pinned: the test extras then find it installed and leave it.
  "$venv/bin/pip" install -q "torch==$release"
  "$venv/bin/pip" install -q -e ".[test]" "torch==$release"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
# The ranks' Inductor caches of this release stay apart from other releases'.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest -m compat ${PYTEST_ARGS:--n 2 -q}
