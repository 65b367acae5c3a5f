#!/usr/bin/env bash
# Run rematc's test suite against one torch release, in a virtual environment of its own.
#
#   bash bench/compat.sh TORCH_VERSION [VENV_DIR] [-- extra pytest args]
#
# VENV_DIR defaults to .venv-torch-TORCH_VERSION under the repo root; an existing one that
# already has that torch is reused as it is. Exits with pytest's status.
# Example: bash bench/compat.sh 2.11.0 -- -m 'not distributed' tests/test_emit.py
set -euo pipefail

usage="usage: bash bench/compat.sh TORCH_VERSION [VENV_DIR] [-- extra pytest args]"
[[ $# -ge 1 && $1 != -* ]] || { echo "$usage" >&2; exit 2; }
version=$1; shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv-torch-$version"
if [[ $# -ge 1 && $1 != -- ]]; then venv=$1; shift; fi
if [[ $# -ge 1 ]]; then
  [[ $1 == -- ]] || { echo "$usage" >&2; exit 2; }
  shift
fi

py="$venv/bin/python"
have=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [[ $have != "$version" ]]; then
  [[ -x $py ]] || python3 -m venv "$venv"
  (cd "$root" && "$py" -m pip install "torch==$version" -e ".[test]")
fi
"$py" -c 'import torch; print("torch", torch.__version__)'
cd "$root"
exec "$py" -m pytest -q -n 2 -p no:cacheprovider "$@"
