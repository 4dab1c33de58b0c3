"""FPLUT (activation lookup tables): the CPU face (fplut_cpu.py) and the CUDA face (fplut_cuda.py)."""
