#!/usr/bin/env bash
# Kept for its command in the docs: the accelerator checks now live in
# tools/accelerator_bench.sh (GPU or TPU); logs under $OUT (or gpu_out).
OUT=${OUT:-gpu_out} exec bash "$(dirname "$0")/accelerator_bench.sh" "$@"
