#!/usr/bin/env bash
# Writes constraints.txt: the exact versions of every package `make setup` installs (torch
# aside: scripts/install-torch.sh picks its CPU or CUDA build by TORCH_VERSION). setup.sh installs with
# `-c constraints.txt`, so a fresh clone, CI and a long-lived checkout test the same versions.
#
# To upgrade: run this script (it resolves the newest versions pyproject.toml allows, in a
# throwaway venv set up as scripts/setup.sh does), run `make test`, commit constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
VENV="$work/venv" CONSTRAINTS=none bash scripts/setup.sh
{
  echo "# Written by scripts/lock.sh ($("$work/venv/bin/python" --version), $(uname -s) $(uname -m))."
  echo "# torch is pinned by scripts/install-torch.sh (TORCH_VERSION). Regenerate: bash scripts/lock.sh"
  "$work/venv/bin/python" -m pip freeze --exclude-editable | grep -viE '^(torch|posttrain)=='
} >"$work/constraints.txt"
mv "$work/constraints.txt" constraints.txt
echo "[lock] wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
