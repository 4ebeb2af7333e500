#!/bin/bash
# Full benchmark run for docs/BENCHMARKS.md (issue 8): greedy table with all methods and peers,
# a sampling table, and the batch sweep with adaptive speculation + gateway overhead.
set -x
cd /work/main
export OMP_NUM_THREADS=1
SETS=mt_bench,humaneval,gsm8k,alpaca,sum,qa
B=.venv/bin/moa-serve
$B bench --eval-sets $SETS --num-prompts 3 --max-new-tokens 128 \
  --methods "ngram;draft-model;eagle3;moa-tli0;moa-tli1" --peers all --out results/full-greedy
$B bench --eval-sets $SETS --num-prompts 1 --max-new-tokens 128 --temperature 0.7 --top-p 0.95 --seed 0 \
  --methods "ngram;eagle3;moa-tli0;moa-tli1" --peers all --out results/full-sampling
$B bench --sweep-only --eval-sets $SETS --num-prompts 11 --max-new-tokens 128 \
  --methods "ngram;eagle3;moa-tli0" --adaptive --batch-sizes 1,2,4,8,16,32,64 --repeats 2 \
  --gateway-overhead --overhead-requests 20 --overhead-tokens 32 --out results/full-sweep
