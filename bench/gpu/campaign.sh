#!/bin/bash
# The GPU campaign of issue 39, one stage per device call (bench/gpu/campaign.py says what each stage runs):
#   bash bench/gpu/campaign.sh tests|model|long_tail|grpo|drafter|notebooks
# Results (campaign-STAGE.json/.md, the benches' files, logs) under $OUT; what later stages read under
# $CAMPAIGN_WORK (default /tmp/campaign, kept while the machine stays warm).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TLTLIB_NO_VENV=1 OUT=${OUT:-/tmp/out}
exec python3 bench/gpu/campaign.py "$@"
