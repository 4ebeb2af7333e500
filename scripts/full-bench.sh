#!/bin/bash
# The full benchmark behind docs/BENCHMARKS.md. 1 torch thread per run (the machine has
# two cores; the other one stays free so runs don't fight over it). About 2 h in total here.
set -ex
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
SETS=mt_bench,humaneval,gsm8k,alpaca,sum,qa
B=.venv/bin/moa-serve
# 1. per prompt, bs 1, greedy: every method and every peer, interleaved prompt by prompt
$B bench --eval-sets $SETS --num-prompts 3 --max-new-tokens 128 \
  --methods "ngram;draft-model;eagle3;moa-tli0;moa-tli1" --peers all --out results/full-greedy
# 2. throughput vs batch size 1..64 with adaptive speculation, 2 repeats; gateway overhead
$B bench --sweep-only --eval-sets $SETS --num-prompts 11 --max-new-tokens 128 \
  --methods "ngram;eagle3;moa-tli0" --adaptive --batch-sizes 1,2,4,8,16,32,64 --repeats 2 \
  --gateway-overhead --overhead-requests 20 --overhead-tokens 32 --out results/full-sweep
# 3. per prompt, bs 1, sampling (T 0.7, top-p 0.95, seeded)
$B bench --eval-sets $SETS --num-prompts 1 --max-new-tokens 128 --temperature 0.7 --top-p 0.95 --seed 0 \
  --methods "ngram;eagle3;moa-tli0;moa-tli1" --peers all --out results/full-sampling
