#!/usr/bin/env bash
# The torch-internals subset of the suite (`pytest -m compat`) on a given torch release, in a fresh venv.
#
#   tests/compat_run.sh 2.15.0            # venv in a new temporary folder, removed afterwards
#   tests/compat_run.sh newest            # the newest release the package registry serves
#   tests/compat_run.sh 2.14.1 /tmp/venv  # venv kept at /tmp/venv (its torch reused while it is that release)
#
# The package goes in without its own torch range, so a release past the range can be checked before
# the range admits it. pip runs with the caller's configuration: where one caps torch below the release
# asked for, lift it for this command (e.g. PIP_CONFIG_FILE=/dev/null). Extra pytest arguments go in
# PYTEST_ARGS (default "-n 2 -q").
set -euo pipefail
release=${1:?usage: tests/compat_run.sh TORCH_RELEASE|newest [VENV_DIR]}
cd "$(dirname "$0")/.."
if [ "$release" = newest ]; then
  release=$(pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p')
  [ -n "$release" ] || { echo "could not read the newest torch release from the package registry" >&2; exit 1; }
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
venv=${2:-$tmp/venv}
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$release')" 2>/dev/null; then
  python -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$release"
fi
"$venv/bin/pip" install -q --no-deps -e .
# The package's other requirements and its test extras, read from pyproject.toml; torch stays pinned.
mapfile -t requirements < <("$venv/bin/python" -c '
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for r in project["dependencies"] + project["optional-dependencies"]["test"]:
    if not r.startswith("torch") or r.startswith("torchtitan"):
        print(r)')
"$venv/bin/pip" install -q "torch==$release" "${requirements[@]}"
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
# Inductor's cache of this run stays apart from other releases' and other runs'.
export TORCHINDUCTOR_CACHE_DIR=$tmp/inductor
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest -m compat ${PYTEST_ARGS:--n 2 -q}
