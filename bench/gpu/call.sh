#!/bin/bash
# One device call of the GPU campaign (bench/gpu/campaign.py says what each runs; docs/gpu.md how a loan is used):
#   bash bench/gpu/call.sh a|b|b2|c
# Everything lands in one tarball in $OUT; the compact tables are printed last.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TLTLIB_NO_VENV=1 PIP_NO_INDEX=1 OUT=${OUT:-/tmp/out}
exec python3 bench/gpu/campaign.py "$@"
