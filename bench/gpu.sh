#!/usr/bin/env bash
# What one GPU measures for lightdist, in one command within 8.5 minutes: throughput and MFU of the 0.95B Llama, and of
# Hugging Face's LlamaForCausalLM in its shape, against plain PyTorch (eager and compiled) and torchtitan's recipe,
# with the operators of one step of each run compared; the GPU-only tests; the checkpoint stall of the 11 GB state.
# Logs go to $OUT (the device machine's) or ./bench-out.
#
#     bash bench/gpu.sh            # torch, lightning and transformers already installed; lightdist need not be
#
# Each part has its own time limit, cut to what is left of the whole's, and each throughput run its own, so that one
# that fails or hangs leaves the others' figures. About 15 s to install and report versions; 270 s of throughput runs,
# most of it compiling, at most 120 s a run; 130 s of tests; the checkpoint stall (about 2 minutes) in what is left,
# printing lightdist's figures before torch's slower saves.
set -u
out=${OUT:-bench-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
budget=495 # seconds for the whole, inside the device run's 8.5 minutes

# A part's time limit: $1 seconds, or what is left of the budget if that is less.
limit() {
    local left=$((budget - SECONDS))
    echo $((left < $1 ? (left > 1 ? left : 1) : $1))
}

if ! python3 -c "import lightdist.plugins" 2>/dev/null; then
    # lightdist and the wheels a GPU image without network lacks, downloaded into .whl/ beforehand (torchdata; for the
    # tests litgpt, jsonargparse, docstring-parser, typeshed-client), into a folder of their own.
    shopt -s nullglob
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/lightdist-site . .whl/*.whl
    export PYTHONPATH=/tmp/lightdist-site
fi
python3 -c "import lightdist.models" || echo "gpu.sh: lightdist does not import: is .whl/ there, with the wheels above?"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, lightning, transformers as t; print('torch', torch.__version__, 'lightning',
    lightning.__version__, 'transformers', t.__version__)" | tee -a "$out/device.txt"

# The comparisons first; the levers (each lightdist-compile with one change) last.
timeout -k 10 "$(limit 270)" python3 bench/throughput.py --preset 1b --batch-size 4 --seq-len 2048 \
    --precision bf16-mixed --steps 10 --warmup 3 --run-timeout 120 \
    --runs plain plain-compile lightdist-compile torchtitan lightdist hf-plain-compile hf-lightdist-compile hf-plain \
    hf-lightdist lightdist-compile-no-autocast lightdist-compile-zero2 \
    --profile "$out/profiles.txt" \
    --profile-runs plain-compile lightdist-compile torchtitan lightdist hf-plain-compile hf-lightdist-compile \
    2>&1 | tee "$out/throughput.log"
# -P: the repository's own lightdist/ (without plugins and models) must not shadow the installed package.
timeout -k 10 "$(limit 130)" python3 -P -m pytest -v -p no:cacheprovider --noconftest tests/test_gpu.py 2>&1 |
    tee "$out/test_gpu.log"
timeout -k 10 "$(limit 130)" python3 bench/checkpoint_stall.py --preset 1b --precision bf16-mixed --local-only 2>&1 |
    tee "$out/checkpoint_stall.log"
echo "gpu.sh: ${SECONDS} s in all" | tee -a "$out/device.txt"
