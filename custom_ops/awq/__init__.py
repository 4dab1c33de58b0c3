"""AWQ 4-bit weights (AutoAWQ GEMM layout): MatMulAWQ and DequantAWQ (CPU and CUDA faces), the small-M tensor-core
GEMV (matmulawq1_cuda.py) and the tensor-core decode constants (common_cuda.py). Imports no other family."""
