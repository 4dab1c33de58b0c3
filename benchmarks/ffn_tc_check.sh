#!/bin/bash
# compute-sanitizer (memcheck on edge shapes of every routed configuration, racecheck on one) and an ncu profile of
# FusedFFN's tensor-core kernel at LLaMA-7B's MLP shape. GPU machine:
#   PYTHONPATH=/tmp/site:.:benchmarks bash benchmarks/ffn_tc_check.sh
set -u
for c in "37 136 33|mt=2, kw=4, ring=2, mfast=True" "5 264 17|mt=1, kw=4, ring=4" "11 8 40|mt=2, kw=2, ring=2" \
         "3 520 9|mt=1, kw=4, ring=4"; do
  shape=${c%%|*}; opts=${c#*|}
  compute-sanitizer --tool memcheck --print-limit 5 python3 benchmarks/ffn_tc_ncu.py $shape "$opts" 2>&1 | grep -E "ERROR SUMMARY|max rel"
done
compute-sanitizer --tool racecheck --print-limit 5 python3 benchmarks/ffn_tc_ncu.py 37 136 33 "mt=2, kw=4, ring=2, mfast=True" 2>&1 | grep -E "HAZARD|RACECHECK SUMMARY|max rel"
for c in "8 4096 11008|mt=1, kw=4, ring=4" "32 4096 11008|mt=2, kw=4, ring=2, mfast=True" "32 4096 11008|mt=4, kw=4, ring=2"; do
  shape=${c%%|*}; opts=${c#*|}
  echo "== ncu M K N = $shape, $opts"
  ncu --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats -k regex:kern \
      --launch-skip 1 --launch-count 1 python3 benchmarks/ffn_tc_ncu.py $shape "$opts" 2>&1 | \
    grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Theoretical Occ|Stall|Warp Cycles Per Issued|Issued Warp|max rel" | head -40
done
