"""The attention block's ops: Rotary, RotaryKV, RMSNorm and KVAttention (CPU and CUDA faces). Imports no other
family."""
