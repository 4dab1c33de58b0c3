# ncu of FusedFFNNF4's default M = 1 kernel at LLaMA-7B gate+up (the wide h2 decode): duration, DRAM bytes and
# throughput, shared-memory wavefronts, issue activity and the stall reasons per issued instruction.
#   bash benchmarks/nf4ffn_stalls.sh        (GPU machine, numpy 2.4 in /tmp/site)
export PYTHONPATH=/tmp/site:.:benchmarks:tests
S=smsp__average_warps_issue_stalled
M=l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
M=$M,dram__bytes_read.sum,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
for r in mio_throttle long_scoreboard short_scoreboard lg_throttle barrier wait math_pipe_throttle not_selected \
         selected tex_throttle dispatch_stall no_instruction drain; do M=$M,${S}_${r}_per_issue_active.ratio; done
ncu --metrics $M -k regex:decode --launch-count 1 python3 -c "
import numpy as np
from onnx_lowbit.custom_ops import fusedffnnf4_cuda as f
k, n = 4096, 11008
r = np.random.default_rng(1)
x = (r.standard_normal((1, k)) * 0.5).astype(np.float16)
q1, q3 = (r.integers(0, 256, k * n // 2, dtype=np.uint8) for _ in range(2))
a1, a3 = ((r.random(k * n // 64) + 0.1).astype(np.float32) for _ in range(2))
f.run_arrays(x, q1, a1, q3, a3, 'nf4', 64, k, n)
" 2>&1 | grep -E "decode|smsp__|l1tex__|dram__|gpu__|sm__" | sed -e 's/smsp__average_warps_issue_stalled_//'
