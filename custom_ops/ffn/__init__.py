"""Fused SwiGLU FFN: FusedFFN (fp32/fp16 weights; CUDA decode, tensor-core and [K, N] kernels), FusedFFNNF4 and
FusedFFNAWQ (the 4-bit weights of nf4/ and awq/, whose kernels they reuse: the one family that imports others)."""
