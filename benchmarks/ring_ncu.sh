# ncu of the wide h2 NF4 decode at LLaMA-7B gate+up, M = 1: the default (first launch), then the ring variant
# (fusedffnnf4_cuda ``ring``): throughput, shared-memory wavefronts and the stall reasons per issued instruction.
#   bash benchmarks/ring_ncu.sh        (GPU machine, numpy 2.4 in /tmp/site)
export PYTHONPATH=/tmp/site:.:benchmarks:tests
S=smsp__average_warps_issue_stalled
M=l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
M=$M,dram__bytes_read.sum,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
for r in mio_throttle long_scoreboard short_scoreboard lg_throttle barrier wait math_pipe_throttle not_selected \
         selected tex_throttle dispatch_stall no_instruction drain; do M=$M,${S}_${r}_per_issue_active.ratio; done
ncu --metrics $M -k regex:decode --launch-count 2 python3 benchmarks/ring_check.py 4096x11008x1 2>&1 | \
  grep -E "decode|smsp__|l1tex__|dram__|gpu__|sm__" | sed -e 's/smsp__average_warps_issue_stalled_//'
