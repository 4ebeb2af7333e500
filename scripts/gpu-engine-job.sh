#!/usr/bin/env bash
# The GPU engine job (moa_serve/benchmarks/gpu_job/ via python -m moa_serve.entrypoints.gpu_job) on a lent GPU machine:
# greedy identity of every drafter on CUDA, bs-1 tok/s / tau per method with transformers `generate` on
# the same GPU, the batch sweep 1/8/64 (vanilla, best drafter, adaptive) and `pytest -m gpu`, in one
# command of <= 10 minutes (the job's own deadline: 8), results back as JSON.
#
# Upload budget: a device command sends the checkout's working tree (tracked + untracked-not-ignored
# files) plus its `carry` paths, <= 64 MiB (67.1 MB) in all. The tree is ~57 MB, ~55 MB of it the shipped
# drafters (tracked: eagle3 19.8, moa-tli0 17.2, moa-tli1 17.2, suffix 0.7 MB); the target's GGUF is
# 98 MB, 90.4 MB xz'd. So `hide-drafters` takes drafters/ out of the tree (moved aside and out of the
# index: the tree is then ~2.2 MB), and what the job needs travels as carry: the xz'd GGUF and the
# four drafters it runs (eagle3, moa-tli1, suffix, medusa; ~29 MB as tar.xz), one payload split in two
# halves of ~58.6 MB, one per command (~61 MB each with the tree). The first half waits in /tmp on the
# machine, which keeps it while the machine stays warm (30 s after a command: send the second command
# at once, nothing in between); `run` joins the halves, puts the drafters back into its copy of the
# tree and runs the job. `prepare` and `budget` print each command's size.
#
#   here:      scripts/gpu-engine-job.sh prepare            # stage/engine/{c1,c2}; prints the budget
#   here:      scripts/gpu-engine-job.sh hide-drafters      # drafters/ out of the tree and the index
#   device 1:  bash scripts/gpu-engine-job.sh stage         # carry: stage/engine/c1
#              (STAGE_TESTS="tests/..." runs those files' `pytest -m gpu` there, STAGE_TESTS_S at most)
#   device 2:  bash scripts/gpu-engine-job.sh run           # carry: stage/engine/c2; timeout_s 600; at once
#   here:      scripts/gpu-engine-job.sh restore-drafters   # drafters/ back (git status as before)
#   here:      scripts/gpu-engine-job.sh collect FILES_AT   # results.json, table.md, job.log, pytest.log
#                                                           #   -> results/gpu-engine/; then give_back
# SMOKE=1 makes `run` first run the job's --smoke on the GPU (~30 s); DEADLINE_MIN (default 8) and
# JOB_ARGS (more flags of python -m moa_serve.entrypoints.gpu_job) change the run; DEVICE=cpu runs `run` here.
# Commit nothing between hide-drafters and restore-drafters.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}                    # the device machine's Python
HERE_PY=${HERE_PY:-.venv/bin/python} # this machine's (prepare, budget)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DRAFTERS="drafters/smollm2-eagle3 drafters/smollm2-moa-tli1 drafters/smollm2-suffix drafters/smollm2-medusa"
S=stage/engine
MACHINE_STAGE=/tmp/moa-engine-stage
LIMIT=$((64 * 1024 * 1024))

tree_bytes() { # bytes of the files a device command sends as the tree (files present only)
  git ls-files -z --cached --others --exclude-standard | $HERE_PY -c "
import os, sys
names = sys.stdin.buffer.read().split(b'\0')
print(sum(os.path.getsize(n) for n in names if n and os.path.isfile(n) and not os.path.islink(n)))"
}

check() { # check N CARRY TREE_BYTES: device command N's size against the 64 MiB limit (2 MiB margin)
  local bytes=$(($(du -sb $S/$2 | cut -f1) + $3))
  awk -v n="$1" -v c="$S/$2" -v b="$bytes" 'BEGIN { printf "device %s (carry %s): %d bytes = %.1f MiB of 64\n", n, c, b, b / 1048576 }'
  [ "$bytes" -lt $((LIMIT - 2097152)) ] || { echo "device $1 is over the budget" >&2; exit 1; }
}

budget() { # both device commands send the tree without drafters/
  local bare
  bare=$(tree_bytes)
  if [ -d drafters ]; then bare=$((bare - $(git ls-files -z drafters | xargs -0 du -cb | tail -1 | cut -f1))); fi
  check 1 c1 "$bare"
  check 2 c2 "$bare"
}

gguf_xz() { # stdout: the target's GGUF, xz'd (the training job's halves are the same stream: reused)
  if [ -f stage/part0/target.gguf.xz.0 ] && [ -f stage/part1/target.gguf.xz.1 ] &&
    [ "$(cat stage/part0/target.gguf.xz.0 stage/part1/target.gguf.xz.1 | xz -dc | sha256sum | cut -d' ' -f1)" = "$1" ]; then
    cat stage/part0/target.gguf.xz.0 stage/part1/target.gguf.xz.1
  else
    xz -9e -T2 -c "$2"
  fi
}

prepare() {
  [ -d drafters ] || { echo "drafters/ is aside: restore-drafters first" >&2; exit 1; }
  mkdir -p $S/c1 $S/c2/eval $S/c2/wheels $S/payload
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx "/stage/" "$exclude" 2>/dev/null || echo "/stage/" >>"$exclude"
  gguf=$($HERE_PY -c "from sglang_ext.models.loader import smollm2_gguf_path; print(smollm2_gguf_path())")
  sha=$(sha256sum "$gguf" | cut -d' ' -f1)
  [ "$(cat $S/payload/gguf.sha256 2>/dev/null)" = "$sha" ] || { gguf_xz "$sha" "$gguf" >$S/payload/target.gguf.xz && echo "$sha" >$S/payload/gguf.sha256; }
  # shellcheck disable=SC2086
  tar -cf - $DRAFTERS | xz -9 -T2 -c >$S/payload/drafters.tar.xz
  tar -cf $S/payload.tar -C $S/payload target.gguf.xz gguf.sha256 drafters.tar.xz
  half=$((($(stat -c %s $S/payload.tar) + 1) / 2))
  head -c $half $S/payload.tar >$S/c1/payload.tar.0
  tail -c +$((half + 1)) $S/payload.tar >$S/c2/payload.tar.1
  rm $S/payload.tar
  wheel=$(ls stage/wheels/gguf-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then cp "$wheel" $S/c2/wheels/; else $HERE_PY -m pip download -q --no-deps -d $S/c2/wheels gguf==0.19.0; fi
  eval_dir=${MOA_SERVE_EVAL_DIR:-../shared/data/eval}
  for f in "$eval_dir"/*.jsonl; do head -n "${EVAL_PROMPTS:-32}" "$f" >$S/c2/eval/"$(basename "$f")"; done
  cp "$eval_dir"/LICENSE* $S/c2/eval/ 2>/dev/null || true
  echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" >$S/c2/commit
  budget
}

unpack() { # device: both halves -> the GGUF in /tmp/moa-target, the drafters into this copy of the tree
  for i in 0 1; do
    [ -f $MACHINE_STAGE/payload.tar.$i ] || {
      echo "payload half $i is not on this machine (given back between the commands?): run both again" >&2
      exit 3
    }
  done
  mkdir -p /tmp/moa-target
  cat $MACHINE_STAGE/payload.tar.0 $MACHINE_STAGE/payload.tar.1 | tar -xf - -C $MACHINE_STAGE
  $PY - "$MACHINE_STAGE" "/tmp/moa-target/$GGUF_NAME" <<'EOF'
import hashlib, lzma, shutil, sys, tarfile
from pathlib import Path

stage, gguf = Path(sys.argv[1]), Path(sys.argv[2])
with lzma.open(stage / "target.gguf.xz") as src, open(gguf, "wb") as dst:
    shutil.copyfileobj(src, dst)
h = hashlib.sha256()
with open(gguf, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
if h.hexdigest() != (stage / "gguf.sha256").read_text().strip():
    sys.exit(f"{gguf}: sha256 differs from the staged GGUF's")
with tarfile.open(stage / "drafters.tar.xz", "r:xz") as tar:
    names = [m for m in tar.getmembers() if not Path(m.name).exists()]  # a tree that has them keeps its own
    tar.extractall(".", members=names, filter="data")
print(f"{gguf} ({gguf.stat().st_size} bytes) and {len(names)} drafter files in place")
EOF
}

case "${1:-}" in
prepare) prepare ;;
budget) budget ;;
hide-drafters)
  [ -d drafters ] || { echo "drafters/ is already aside ($S/drafters.aside)" >&2; exit 1; }
  git rm -r -q --cached drafters
  mv drafters $S/drafters.aside
  echo "drafters/ moved to $S/drafters.aside; the tree is now $(tree_bytes) bytes"
  ;;
restore-drafters)
  mv $S/drafters.aside drafters
  git reset -q -- drafters
  git diff --quiet -- drafters && echo "drafters/ restored" || { echo "drafters/ differs from the index" >&2; exit 1; }
  ;;
stage) # device, command 1: keep the first half outside the repo copy; then the GPU tests that need no
  # real weights (STAGE_TESTS, bounded by STAGE_TESTS_S seconds), so command 2's deadline goes to the job
  mkdir -p $MACHINE_STAGE
  cp $S/c1/payload.tar.0 $MACHINE_STAGE/
  ls -l $MACHINE_STAGE
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  if [ -n "${STAGE_TESTS:-}" ]; then
    log=${OUT:-runs/gpu-engine-out}/stage-pytest.log
    mkdir -p "$(dirname "$log")"
    # shellcheck disable=SC2086
    PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 timeout "${STAGE_TESTS_S:-90}" $PY -m pytest -q -p no:cacheprovider \
      -m gpu $STAGE_TESTS >"$log" 2>&1 || echo "stage tests: rc $?"
    tail -5 "$log"
  fi
  ;;
run) # device, command 2
  out=${OUT:-runs/gpu-engine-out}
  mkdir -p "$out" $MACHINE_STAGE
  cp $S/c2/payload.tar.1 $MACHINE_STAGE/
  unpack
  $PY -m pip install -q --no-index --no-deps --target /tmp/moa-pylib $S/c2/wheels/gguf-*.whl
  export PYTHONPATH="$PWD:/tmp/moa-pylib" PYTHONUNBUFFERED=1 MOA_SERVE_EVAL_DIR="$PWD/$S/c2/eval"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  if [ -n "${SMOKE:-}" ]; then
    $PY -m moa_serve.entrypoints.gpu_job --smoke --device "${DEVICE:-cuda}" --out /tmp/moa-gpu-smoke --eval-sets mt_bench \
      --gpu-tests none 2>&1 | tail -25
  fi
  # shellcheck disable=SC2086
  $PY -m moa_serve.entrypoints.gpu_job --target-gguf /tmp/moa-target/$GGUF_NAME --device "${DEVICE:-cuda}" --out "$out" \
    --deadline-min "${DEADLINE_MIN:-8}" --commit "$(cat $S/c2/commit)" ${JOB_ARGS:-} 2>&1 | tee "$out/job.log"
  ;;
collect) # here: FILES_AT of the run command
  mkdir -p results/gpu-engine
  cp "$2"/* results/gpu-engine/
  cat results/gpu-engine/table.md
  ;;
*)
  sed -n 2,30p "$0"
  exit 2
  ;;
esac
