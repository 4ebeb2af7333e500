#!/usr/bin/env bash
# The drafter training job (sglang_ext/training/job.py) on a lent GPU machine, whose commands carry at
# most 64 MiB each and which reaches no package index: the target's GGUF (98 MB) travels xz-compressed
# in two parts over two back-to-back commands, with the token shards and gguf's wheel.
#
#   here:      scripts/gpu-train-job.sh prepare           # stage/: target parts, gguf wheel; runs/shards if missing
#   device 1:  bash scripts/gpu-train-job.sh stage        # carry: stage/part0
#   device 2:  bash scripts/gpu-train-job.sh run          # carry: stage/part1, stage/wheels, runs/shards
#   here:      scripts/gpu-train-job.sh unpack FILES_DIR   # the heads, curves and summary into runs/gpu-job
#
# `run` first runs the job's --smoke mode on the GPU (seconds), so a device-only error costs seconds, not
# the run (SKIP_SMOKE=1 skips it). TIME_BUDGET_MIN / DEADLINE_MIN size the run (defaults fit a 10-minute command); SHARDS and
# JOB_ARGS change the data and the job's flags. Fine-tuning: put heads into stage/part0/init/<head>/ or
# stage/part1/init/<head>/ (whichever has room; PART0_BYTES moves the split) and they start from there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PART0_BYTES=${PART0_BYTES:-62000000}

case "${1:-}" in
prepare)
  PY=.venv/bin/python
  mkdir -p stage/part0 stage/part1 stage/wheels
  grep -qx "/stage/" .git/info/exclude 2>/dev/null || echo "/stage/" >>.git/info/exclude
  gguf=$($PY -c "from sglang_ext.models.loader import smollm2_gguf_path; print(smollm2_gguf_path())")
  xz -9e -T2 -c "$gguf" >stage/target.gguf.xz
  head -c $PART0_BYTES stage/target.gguf.xz >stage/part0/target.gguf.xz.0
  tail -c +$((PART0_BYTES + 1)) stage/target.gguf.xz >stage/part1/target.gguf.xz.1
  rm stage/target.gguf.xz
  $PY -m pip download -q --no-deps -d stage/wheels gguf==0.19.0
  [ -f runs/shards/manifest.json ] || $PY -m entrypoints.cli train pack --data sharegpt --data ../shared/data/distill --out runs/shards
  du -sh stage/* runs/shards
  ;;
stage)
  mkdir -p /tmp/moa-stage && cp -r stage/part0/. /tmp/moa-stage/
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ;;
run)
  out=${OUT:-runs/gpu-out}
  mkdir -p "$out" /tmp/moa-target
  cp -r stage/part1/. /tmp/moa-stage/
  cat /tmp/moa-stage/target.gguf.xz.0 /tmp/moa-stage/target.gguf.xz.1 |
    $PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), open('/tmp/moa-target/$GGUF_NAME', 'wb'))"
  $PY -m pip install -q --no-index --no-deps --target /tmp/moa-pylib stage/wheels/gguf-*.whl
  export PYTHONPATH="$PWD:/tmp/moa-pylib" PYTHONUNBUFFERED=1
  shards=${SHARDS:-runs/shards}
  init=()
  [ -d /tmp/moa-stage/init ] && init=(--init-from /tmp/moa-stage/init)
  [ -n "${SKIP_SMOKE:-}" ] || $PY -m entrypoints.train_job --shards "$shards" --out /tmp/moa-smoke --smoke --device cuda 2>&1 | tail -3
  # shellcheck disable=SC2086
  $PY -m entrypoints.train_job --shards "$shards" --target-gguf /tmp/moa-target/$GGUF_NAME --out /tmp/moa-job --pack "$out" \
    --device cuda --time-budget-min "${TIME_BUDGET_MIN:-6.5}" --deadline-min "${DEADLINE_MIN:-8.2}" "${init[@]}" ${JOB_ARGS:-} 2>&1 | tee "$out/job.log"
  cp /tmp/moa-job/summary.json "$out/summary.json"
  ;;
unpack)
  .venv/bin/python -c "import sys; from pathlib import Path; from sglang_ext.training.job import unpack_outputs; unpack_outputs(Path(sys.argv[1]), Path('runs/gpu-job'))" "$2"
  ls -R runs/gpu-job | head -30
  ;;
*)
  sed -n 2,14p "$0"
  exit 2
  ;;
esac
