"""QuantGRU (integer GRU): the CPU face, the CUDA face (quantgru_cuda.py), its per-call parameter kernel
(quantgru_prep_cuda.py) and what both share (common_cuda.py). Imports no other family."""
