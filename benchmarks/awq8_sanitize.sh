#!/bin/bash
# compute-sanitizer on the small-M AWQ GEMV at M = 2 .. 16 (edge shapes and LLaMA-size; M > 8: two chunks of 8
# rows); GPU machine:
#   PYTHONPATH=/tmp/site:.:benchmarks bash benchmarks/awq8_sanitize.sh
for c in "3 mm1 688 1000 wpl=1" "8 ffn1 688 1000 wpl=1" "5 mm1 4096 11008 wpl=2" "2 ffn1 4096 11008 wpl=1" \
         "13 mm1 688 1000 wpl=1" "16 ffn1 688 1000 wpl=1" "9 ffn1 4096 11008 wpl=1"; do
  set -- $c
  M=$1 compute-sanitizer --tool memcheck --print-limit 5 python3 benchmarks/awq_ncu.py $2 $3 $4 "$5" 2>&1 | grep -E "ERROR SUMMARY|rel "
done
for m in 6 12; do
  M=$m compute-sanitizer --tool racecheck --print-limit 5 python3 benchmarks/awq_ncu.py ffn1 688 1000 "wpl=1" 2>&1 | grep -E "RACECHECK SUMMARY|rel "
done
