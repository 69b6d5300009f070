#!/usr/bin/env bash
# What one GPU measures for lightdist, in one command: the GPU-only tests, throughput and MFU of the 0.95B Llama
# against plain PyTorch (eager and compiled) and Lightning, with a profile of lightdist's step, and the checkpoint
# stall of its 11 GB state. Logs go to $OUT (the device machine's) or ./bench-out.
#
#     bash bench/gpu.sh            # torch, lightning and transformers already installed; lightdist need not be
#
# Each part has its own time limit, so that one that fails or hangs leaves the others' figures.
set -u
out=${OUT:-bench-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import lightdist.plugins" 2>/dev/null; then
    # lightdist and the wheels a GPU image without network lacks, downloaded into .whl/ beforehand (torchdata; for the
    # tests litgpt, jsonargparse, docstring-parser, typeshed-client), into a folder of their own.
    shopt -s nullglob
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/lightdist-site . .whl/*.whl
    export PYTHONPATH=/tmp/lightdist-site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" |
    tee -a "$out/device.txt"

timeout 270 python3 bench/throughput.py --preset 1b --batch-size 4 --seq-len 2048 --precision bf16-mixed \
    --steps 10 --warmup 3 --profile "$out/lightdist_ops.txt" \
    --runs plain plain-compile lightdist lightdist-compile lightning lightdist-offload 2>&1 | tee "$out/throughput.log"
timeout 120 python3 bench/checkpoint_stall.py --preset 1b --precision bf16-mixed --local-only 2>&1 |
    tee "$out/checkpoint_stall.log"
# -P: the repository's own lightdist/ (without plugins and models) must not shadow the installed package.
timeout 130 python3 -P -m pytest -v -p no:cacheprovider --noconftest tests/test_gpu.py 2>&1 | tee "$out/test_gpu.log"
