"""The C shim's ABI as Python sees it: the limits ortshim.c is compiled with, the element-type tables, and the
ctypes mirrors of its structs (LbTensor, LbStep, LbPlan). bridge.py and plans.py both use them."""
from __future__ import annotations

import ctypes

import numpy as np

SHIM_ABI = 4   # ortshim.c's lb_abi(): the interface this Python code speaks
MAX_IO = 16
MAX_DIMS = 8

# ONNXTensorElementDataType -> numpy dtype (bf16 travels as uint16 bit patterns)
NP_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
             10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64, 16: np.uint16}
TYPE_NAMES = {1: "float", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
              10: "float16", 11: "double", 12: "uint32", 13: "uint64", 16: "bfloat16"}


class LbTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dims", ctypes.c_int64 * MAX_DIMS),
                ("elem_type", ctypes.c_int32), ("ndim", ctypes.c_int32)]


MAX_PLAN_STEPS, MAX_PARAMS, MAX_PATCH = 16, 192, 16
KEY_MAX = 2 + MAX_IO * (3 + MAX_DIMS)
_i64 = ctypes.c_int64


class LbStep(ctypes.Structure):
    """Mirror of ortshim.c's LbStep: a kernel launch (kind 0), a cublasGemmEx call (kind 1), a cooperative launch
    (kind 2), a CPU entry point (kind 3) or a programmatic dependent launch (kind 4)."""
    _fields_ = [("kind", _i64), ("func", ctypes.c_uint64), ("grid", _i64), ("block", _i64), ("shmem", _i64),
                ("n_params", _i64), ("n_patch", _i64), ("params", ctypes.c_uint64 * MAX_PARAMS), ("patch_slot", _i64 * MAX_PATCH),
                ("patch_kind", _i64 * MAX_PATCH), ("patch_index", _i64 * MAX_PATCH), ("patch_off", _i64 * MAX_PATCH)]


class LbPlan(ctypes.Structure):
    """Mirror of ortshim.c's LbPlan: a compute call recorded for native replay (see plans.py)."""
    _fields_ = [("valid", _i64), ("never", _i64), ("scratch", _i64), ("n_out", _i64), ("out_ndim", _i64 * MAX_IO),
                ("out_dims", (_i64 * MAX_DIMS) * MAX_IO), ("n_steps", _i64), ("steps", LbStep * MAX_PLAN_STEPS),
                ("key_len", _i64), ("key", _i64 * KEY_MAX)]
