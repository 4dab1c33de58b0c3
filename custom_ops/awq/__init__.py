"""AWQ 4-bit weights (AutoAWQ GEMM layout): MatMulAWQ and DequantAWQ (CPU and CUDA faces), the kernels MatMulAWQ and
FusedFFNAWQ share (gemv_cuda: the fp32 decode and generic kernels; matmulawq1_cuda: the small-M tensor-core GEMV;
session_cuda: their kernel object and routing conditions), the tensor-core decode constants and the AWQ launch
answers under the simulator (common_cuda.py). Imports no other family."""
