"""NF4/FP4 4-bit weights: MatMulNF4 and DequantNF4 (CPU and CUDA faces), the shared format checks (common.py), the M=1
decode kernel generator that MatMulNF4 and FusedFFNNF4 share (decode_cuda.py), and the tensor-core (nf4tc_cuda.py,
nf4mma_cuda.py) and warp-column (nf4warp_cuda.py) kernels. Imports no other family."""
