#!/usr/bin/env bash
# Creates .venv/ with PyTorch's CPU build and lightdist installed editable, with the test, cloud-storage and Ray
# extras.
# PyTorch goes first and pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet "${LIGHTDIST_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[test,cloud,ray]"
# LitGPT's model code is in the tests' model zoo; its own pins (an older transformers) conflict with the test extra's,
# so it goes in without them, as its users with transformers 5 install it.
.venv/bin/python -m pip install --quiet --no-deps "litgpt==0.5.13"
