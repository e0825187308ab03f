#!/bin/bash
# GPU session, call 2 (one H100, < 10 min): CUDA tests; eager vs graphs; the 24-layer reasoner and its drafter trained
# on the GPU (kept in /tmp/gpu24 for a follow-up call); SD vs plain on it. Results and logs under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TLTLIB_NO_VENV=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp pytest
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tail -8
stamp graphs
timeout 100 python3 bench/graphs.py --preset gpu-24l --batches 1,16 --new-tokens 96 --repeats 3 --out "$OUT" 2>&1 \
    | grep "^|"
stamp reasoner
timeout 240 python3 -m tltlib train-reasoner --preset gpu-24l --device cuda --steps 700 --minutes 2.6 --lr 4e-4 \
    --eval-problems 64 --out /tmp/gpu24 --quiet > "$OUT/reasoner.log" 2>&1; grep -A4 "^| decoding" "$OUT/reasoner.log"
grep -i "minutes$\|error" "$OUT/reasoner.log" | head -3
stamp drafter
timeout 150 python3 -m tltlib train-drafter --model /tmp/gpu24 --out /tmp/gpu24-drafter --device cuda --steps 500 \
    --quiet > "$OUT/drafter.log" 2>&1; grep -i "tokens per step\|top-1\|error" "$OUT/drafter.log" | head -4
stamp speculative
timeout 170 python3 bench/speculative.py --model /tmp/gpu24 --drafter /tmp/gpu24-drafter --device cuda \
    --dtype bfloat16 --batches 1,4,16 --temperatures 0.9 --strategies "chain-4;chain-8;tree-6x4-24" --repeats 3 \
    --assistant none --out "$OUT" 2>&1 | grep "^|"
stamp done
