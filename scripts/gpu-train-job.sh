#!/usr/bin/env bash
# The drafter training job (sglang_ext/training/job.py) on a lent GPU machine. A device command carries at
# most 64 MiB, the tree included, and the machine reaches no package index; drafters/ alone is ~57 MB. So
# drafters/ leaves the tree (gpu-engine-job.sh hide-drafters) and everything the job needs travels as one
# payload in as few equal chunks as fit, one per device command, sent back to back (the machine
# keeps /tmp while it stays warm: 30 s after a command): the target's GGUF (xz), the token shards (SHARDS,
# default runs/shards), gguf's wheel and, with INIT_HEADS (e.g. "eagle3 moa-tli1"), the shipped heads the
# run continues from (--init-from; a variant head `moa-tli1@...` starts from its base head's).
#
#   here:      INIT_HEADS="eagle3 moa-tli1" scripts/gpu-train-job.sh prepare   # stage/train/c1..cN, sizes
#   here:      scripts/gpu-engine-job.sh hide-drafters          # drafters/ out of the tree and the index
#   device k:  bash scripts/gpu-train-job.sh stage              # carry: stage/train/c<k>, k = 1 .. N-1
#   device N:  bash scripts/gpu-train-job.sh run                # carry: stage/train/c<N>; timeout_s 600
#   here:      scripts/gpu-engine-job.sh restore-drafters
#   here:      scripts/gpu-train-job.sh unpack FILES_DIR        # heads, curves, summary -> runs/gpu-job
#
# `run` first runs the job's --smoke mode on the GPU (seconds), so a device-only error costs seconds, not
# the run (SKIP_SMOKE=1 skips it; SMOKE_ONLY=1 stops after it: with DEVICE=cpu, the CPU check of the
# staging). TIME_BUDGET_MIN / DEADLINE_MIN size the run (defaults fit a 10-minute command); JOB_ARGS adds
# the job's flags (e.g. --heads eagle3,moa-tli1,moa-tli1@lambda_feat=0.3 --lr 3e-4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}                    # the device machine's Python
HERE_PY=${HERE_PY:-.venv/bin/python} # this machine's
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
S=stage/train
MACHINE_STAGE=/tmp/moa-train-stage
LIMIT=$((64 * 1024 * 1024))

prepare() {
  [ -d drafters ] || { echo "drafters/ is aside: scripts/gpu-engine-job.sh restore-drafters first" >&2; exit 1; }
  rm -rf $S && mkdir -p $S/payload/init
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx "/stage/" "$exclude" 2>/dev/null || echo "/stage/" >>"$exclude"
  gguf=$($HERE_PY -c "from sglang_ext.models.loader import smollm2_gguf_path; print(smollm2_gguf_path())")
  sha=$(sha256sum "$gguf" | cut -d' ' -f1)
  engine=stage/engine/payload # the engine job's xz'd GGUF, when it is this one
  if [ "$(cat $engine/gguf.sha256 2>/dev/null)" = "$sha" ]; then cp $engine/target.gguf.xz $S/payload/; else xz -9e -T2 -c "$gguf" >$S/payload/target.gguf.xz; fi
  echo "$sha" >$S/payload/gguf.sha256
  shards=${SHARDS:-runs/shards}
  [ -f "$shards/manifest.json" ] || $HERE_PY -m moa_serve.entrypoints.cli train pack --data sharegpt --data ../shared/data/distill --out "$shards"
  tar -cf $S/payload/shards.tar -C "$shards" .
  for h in ${INIT_HEADS:-}; do cp -rL "drafters/smollm2-$h" "$S/payload/init/$h"; done
  $HERE_PY -m pip download -q --no-deps -d $S/payload gguf==0.19.0
  echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" >$S/payload/commit
  tar -cf - -C $S/payload . | xz -0 -T2 -c >$S/payload.tar.xz # (the GGUF is xz'd already: -0 packs the rest)
  rm -rf $S/payload
  # the fewest device commands, in equal chunks, each within the limit with the tree beside it
  total=$(stat -c %s $S/payload.tar.xz)
  room=$((LIMIT - 3 * 1024 * 1024 - $(tree_bytes)))
  n=$(((total + room - 1) / room))
  split -b $(((total + n - 1) / n)) -d -a 2 $S/payload.tar.xz $S/chunk.
  rm $S/payload.tar.xz
  k=0
  for f in $S/chunk.*; do
    k=$((k + 1))
    mkdir -p $S/c$k
    mv "$f" $S/c$k/payload.$k
    echo "$n" >$S/c$k/chunks
  done
  budget
}

tree_bytes() { # bytes of the tree a device command sends, drafters/ left out (hide-drafters)
  git ls-files -z --cached --others --exclude-standard | $HERE_PY -c "
import os, sys
names = sys.stdin.buffer.read().split(b'\0')
print(sum(os.path.getsize(n) for n in names if n and os.path.isfile(n) and not os.path.islink(n) and not n.startswith(b'drafters/')))"
}

budget() { # every device command sends the tree without drafters/ and one chunk
  local bare bytes
  bare=$(tree_bytes)
  for c in $S/c*; do
    bytes=$(($(du -sb "$c" | cut -f1) + bare))
    awk -v c="$c" -v b="$bytes" 'BEGIN { printf "device command (carry %s): %d bytes = %.1f MiB of 64\n", c, b, b / 1048576 }'
    [ "$bytes" -lt $((LIMIT - 2097152)) ] || { echo "$c is over the budget" >&2; exit 1; }
  done
}

take() { # device: this command's chunk into the machine's stage
  mkdir -p $MACHINE_STAGE
  for c in $S/c*; do cp "$c"/payload.* $MACHINE_STAGE/; done
  ls -l $MACHINE_STAGE
}

unpack_payload() { # device: every chunk -> the GGUF in /tmp/moa-target, the shards, the init heads, the wheel
  for c in $S/c*; do n=$(cat "$c/chunks") && break; done
  for k in $(seq 1 "$n"); do
    [ -f $MACHINE_STAGE/payload.$k ] || {
      echo "chunk $k of $n is not on this machine (given back between the commands?): send them all again" >&2
      exit 3
    }
  done
  mkdir -p /tmp/moa-target $MACHINE_STAGE/p
  for k in $(seq 1 "$n"); do cat $MACHINE_STAGE/payload.$k; done | xz -dc | tar -xf - -C $MACHINE_STAGE/p
  $PY - "$MACHINE_STAGE/p" "/tmp/moa-target/$GGUF_NAME" <<'EOF'
import hashlib, lzma, shutil, sys
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
print(f"{gguf}: {gguf.stat().st_size} bytes; commit {(stage / 'commit').read_text().strip()}")
EOF
  mkdir -p $MACHINE_STAGE/shards && tar -xf $MACHINE_STAGE/p/shards.tar -C $MACHINE_STAGE/shards
  $PY -m pip install -q --no-index --no-deps --target /tmp/moa-pylib $MACHINE_STAGE/p/gguf-*.whl
}

case "${1:-}" in
prepare) prepare ;;
budget) budget ;;
stage) # device, commands 1 .. N-1
  take
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
  ;;
run) # device, command N
  out=${OUT:-runs/gpu-out}
  mkdir -p "$out"
  take
  unpack_payload
  export PYTHONPATH="$PWD:/tmp/moa-pylib" PYTHONUNBUFFERED=1
  device=${DEVICE:-cuda}
  init=()
  [ -n "$(ls -A $MACHINE_STAGE/p/init 2>/dev/null)" ] && init=(--init-from $MACHINE_STAGE/p/init)
  [ -n "${SKIP_SMOKE:-}" ] || $PY -m moa_serve.entrypoints.train_job --shards $MACHINE_STAGE/shards --out /tmp/moa-smoke --smoke \
    --device "$device" 2>&1 | tail -3
  [ -z "${SMOKE_ONLY:-}" ] || exit 0
  # shellcheck disable=SC2086
  $PY -m moa_serve.entrypoints.train_job --shards $MACHINE_STAGE/shards --target-gguf /tmp/moa-target/$GGUF_NAME --out /tmp/moa-job \
    --pack "$out" --device "$device" --time-budget-min "${TIME_BUDGET_MIN:-6.5}" --deadline-min "${DEADLINE_MIN:-8.2}" \
    "${init[@]}" ${JOB_ARGS:-} 2>&1 | tee "$out/job.log"
  cp /tmp/moa-job/summary.json "$out/summary.json"
  ;;
unpack)
  $HERE_PY -c "import sys; from pathlib import Path; from sglang_ext.training.job import unpack_outputs; unpack_outputs(Path(sys.argv[1]), Path('runs/gpu-job'))" "$2"
  ls -R runs/gpu-job | head -30
  ;;
*)
  sed -n 2,20p "$0"
  exit 2
  ;;
esac
