#!/bin/bash
# GPU session, call 1: the CUDA tests, eager vs graphs on random weights, and a timing probe of the SFT recipe.
# Run from the project root on the device machine: bash bench/gpu/probe.sh  (writes logs and results under $OUT)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TLTLIB_NO_VENV=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/pytest-gpu.log" | tail -25
timeout 200 python3 bench/graphs.py --preset gpu-24l --batches 1,4,16,64 --new-tokens 96 --repeats 3 \
    --out "$OUT" 2>&1 | tail -15
timeout 120 python3 -m tltlib train-reasoner --preset gpu-24l --device cuda --steps 60 --minutes 1.5 --lr 3e-4 \
    --eval-problems 8 --out /tmp/probe --quiet 2>&1 | grep -i "minutes\|error\|Traceback" | head
