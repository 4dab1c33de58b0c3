"""PTX snapshot of every CUDA kernel variant the product can launch, compiled without a GPU (development tool).

Proves that a refactor of custom_ops/ (modules moved into subpackages, helpers moved, factories renamed) left the
generated code unchanged: snapshot before, snapshot after, compare.

    python benchmarks/ptx_snapshot.py OUTDIR [-j 2] [--only REGEX]   # compile, write OUTDIR/<id>.ptx + index.tsv
    python benchmarks/ptx_snapshot.py --compare DIR_A DIR_B [--diffs 3]   # exit 1 when any variant differs
    python benchmarks/ptx_snapshot.py --list                            # the table and the kernel-site coverage

Needs libNVVM and NVRTC (pip: nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12) and numba-cuda; runs outside the
simulator (NUMBA_ENABLE_CUDASIM is removed from the environment). Each variant is compiled with
numba.cuda.compile_ptx(py_func, signature, cc=(9, 0)) and the kernel's own compile options (fastmath, opt, debug,
lineinfo, forceinline, launch_bounds); max_registers and the other linker-side options are not in PTX, so the
normalised file's first lines record them. Normalisation: every mangled identifier (``_Z...``: they contain the
module path) becomes SYMn in order of first appearance (``_param_k`` suffixes kept), comment lines and trailing
comments, ``.version``, ``.file`` and ``.loc`` lines are dropped; OUTDIR/toolchain.txt keeps the compiler versions
(--compare notes when they differ: another NVVM may generate other code).

After the refactor, repoint MODULES (one line per moved module, relative to onnx_lowbit.custom_ops). Factory
names are looked up as written, and a name ``_make...`` missing from its module is also tried as ``make...`` (and
the reverse), since the refactor may drop the underscore.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time

PACKAGE = "onnx_lowbit.custom_ops"
TOOLCHAIN = "toolchain.txt"     # numba / numba-cuda versions and the PTX headers' compiler lines
CC = (9, 0)

# ------------------------------------------------------------------------------------------------- the table
MODULES = {     # alias -> module relative to onnx_lowbit.custom_ops: repoint here after a move
    "launch": "device.launch",
    "fusedffn_decode": "ffn.fusedffn_decode_cuda",
    "fusedffn_prefill": "ffn.fusedffn_prefill_cuda",
    "fusedffn_kn": "ffn.fusedffn_kn_cuda",
    "fusedffn_tc": "ffn.fusedffn_tc_cuda",
    "fusedffn_kn_tc": "ffn.fusedffn_kn_tc_cuda",
    "fplut": "fplut.fplut_cuda",
    "rmsnorm": "attention.rmsnorm_cuda",
    "rotary": "attention.rotary_cuda",
    "rotarykv": "attention.rotarykv_cuda",
    "kvattention": "attention.kvattention_cuda",
    "dequantnf4": "nf4.dequantnf4_cuda",
    "dequantawq": "awq.dequantawq_cuda",
    "matmulnf4": "nf4.matmulnf4_cuda",
    "fusedffnnf4": "ffn.fusedffnnf4_cuda",
    "nf4tc": "nf4.nf4tc_cuda",
    "nf4warp": "nf4.nf4warp_cuda",
    "nf4mma": "nf4.nf4mma_cuda",
    "awqgemv": "awq.gemv_cuda",
    "matmulawq1": "awq.matmulawq1_cuda",
    "fusedffnawq": "ffn.fusedffnawq_cuda",
    "quantgru_xproj": "gru.quantgru_xproj_cuda",
    "quantgru_rec": "gru.quantgru_rec_cuda",
    "quantgru_prep": "gru.quantgru_prep_cuda",
}

# (variant id, module alias, factory expression, signature expression): both expressions are evaluated in the
# module's namespace plus ``Array`` (cuda_launch.Array) and ``np``; the signature is the list the routing code
# gives cuda_launch.Launcher. The configurations are those each op's kernel object compiles or its compute / run
# can route to (read from the launch code at commit b7e2c89; see the comments).
VARIANTS = []
_T = {False: "f32", True: "f16"}
_A = {False: "Array(np.float32)", True: "Array(np.uint16)"}      # fp16 passed as uint16 bits
_D = {"f32": "np.float32", "f16": "np.float16"}


def _add(vid, mod, factory, signature):
    VARIANTS.append((vid, mod, factory, signature))


# FusedFFN: T, TW in {float, float16}, the kernels fusedffn_cuda.ROUTES names. [N, K]: decode buckets 1, 2
# (fusedffn_decode), the tiled kernel (fusedffn_prefill; [K, N] with kn=True); [K, N] (weights_kn=1): fusedffn_kn
# decode (M <= 2, TUNED u/db); the cuBLAS path's act (x16, g16: fp16 G only with fp16 X and W, [K, N]), widen,
# split; fp16 X and W: fusedffn_tc's CONFIGS, fusedffn_kn_tc's CONFIGS. Variant ids as before the routing table
# (the decode buckets 4, 8, 16 are gone: docs/lab-log.md, "Removed kernel variants (float FFN)").
for _x in (False, True):
    for _w in (False, True):
        _t = f"{_T[_x]}x.{_T[_w]}w"
        for _mt in (1, 2):
            _add(f"fusedffn.decode.mt{_mt}.{_t}", "fusedffn_decode", f"make({_mt}, {_x}, {_w})",
                 f"[{_A[_x]}, Array(np.uint32), Array(np.uint32), {_A[_x]}, {_A[_x]}, {_A[_x]}] + ['int64'] * 5")
        for _kn in (False, True):
            _add(f"fusedffn.tiled.{'kn' if _kn else 'nk'}.{_t}", "fusedffn_prefill",
                 f"make_tiled({_x}, {_w}, **TILE, kn={_kn})", f"sig('tiled', {_x}, {_w})")
        for _mt in (1, 2):
            _add(f"fusedffn_kn.decode.mt{_mt}.{_t}", "fusedffn_kn",
                 f"make({_mt}, {_x}, {_w}, TUNED[{_mt}]['u'], TUNED[{_mt}]['db'])",
                 f"[{_A[_x]}, Array(np.uint32), Array(np.uint32), {_A[_x]}, {_A[_x]}, {_A[_x]}, Array(np.float32), "
                 f"Array(np.uint32)] + ['int64'] * 7")
for _x, _g in ((False, False), (True, False), (True, True)):
    _add(f"fusedffn.act.{_T[_x]}x.{_T[_g]}g", "fusedffn_prefill", f"make_act({_x}, {_g})", f"sig('act', {_x}, {_g})")
_add("fusedffn.widen", "fusedffn_prefill", "make_widen()", "sig('widen', False, False)")
_add("fusedffn.split", "fusedffn_prefill", "make_split()", "sig('split', False, False)")
for _rows, (_mt, _kw, _ring, _mf) in ((8, (1, 4, 4, False)), (16, (2, 2, 2, False)), (32, (2, 4, 2, True))):
    _add(f"fusedffn_tc.m{_rows}", "fusedffn_tc", f"make({_mt}, {_kw}, {_ring}, {_mf})", "sig()")
for _rows, (_mt, _kw, _ring) in ((8, (1, 4, 2)), (16, (2, 4, 2))):
    _add(f"fusedffn_kn_tc.m{_rows}", "fusedffn_kn_tc", f"make({_mt}, {_kw}, {_ring})", "sig()")

# FPLUT: one 16-bit kernel (fp16 and bf16), one fp32 kernel (fplut_cuda.ROUTES)
for _k, _edt, _n in (("fplut16", "np.uint16", "16bit"), ("fplut32", "np.uint32", "f32")):
    _add(f"fplut.{_n}", "fplut", f"KERNELS['{_k}'][0]",
         f"[Array(np.uint64), Array(np.uint64), Array({_edt}), Array({_edt}), Array(np.uint64), 'int64']")

# RMSNorm: register kernel (ept 8) or two passes (ept 0), skip and H present or not
for _f in (False, True):
    for _ept in (8, 0):
        for _s in (False, True):
            for _h in (False, True):
                _add(f"rmsnorm.{_T[_f]}.{'ept8' if _ept else 'twopass'}.skip{int(_s)}.h{int(_h)}", "rmsnorm",
                     f"_make({_f}, {_ept}, {_s}, {_h})",
                     f"[{_A[_f]}] * 5 + ['int64', 'int64', 'float32']")

# Rotary, RotaryKV (element or 8-byte copy units), KVAttention (element or wide units)
for _e in (10, 1):
    _n = "f16" if _e == 10 else "f32"
    _add(f"rotary.{_n}", "rotary", f"KERNELS['rotary{_n[1:]}']", f"_signature('rotary{_n[1:]}')")
    for _wide in (False, True):
        _u = "wide" if _wide else "elem"
        _add(f"rotarykv.{_n}.{_u}", "rotarykv", f"KERNELS[{_e}]", f"_signature({_e}, {_wide})")
        _add(f"kvattention.{_n}.{_u}", "kvattention", f"kernel_for({_e}, {_wide})", f"_signature({_e}, {_wide})")

# DequantNF4: transposed=0 (dequant_kn); transposed=1: DEFAULT[dtype]'s vector kernel, LEGACY's dequant_rows
# (unaligned packed input)
for _n, _d in _D.items():
    _f16 = _n == "f16"
    _add(f"dequantnf4.kn.{_n}", "dequantnf4", "dequant_kn",
         f"[Array(np.uint8), Array({_d}), Array(np.float32), Array({_d}), 'int64', 'int64', 'int64']")
    _add(f"dequantnf4.rows.{_n}", "dequantnf4", "dequant_rows",
         f"[Array(np.uint64), Array(np.uint8), Array({_d}), Array(np.float32), Array({_d}), 'int64', 'int64', 'int64']")
    _ow, _oe = ("np.uint32", "np.uint16") if _f16 else ("np.float32", "np.float32")
    _v = f"DEFAULT['{'float16' if _f16 else 'float32'}']"
    _add(f"dequantnf4.vec.{_n}", "dequantnf4", f"_make_vec(*{_v}.kernel_key({_f16}))",
         f"[Array(_QTYPE[{_v}.epv]), Array(np.uint8), Array({_d}), Array(np.float32), Array({_ow}), Array({_oe}), "
         f"'int64', 'int64']")
# FusedFFNNF4's prefill route (ffn/fusedffn4_prefill_cuda): the transposed kernels with fp32 absmax, fp16 W^T
# (dequantnf4_cuda._launcher(..., absmax=np.float32))
_add("dequantnf4.vec.f16.am32", "dequantnf4", "_make_vec(*DEFAULT['float16'].kernel_key(True))",
     "[Array(_QTYPE[DEFAULT['float16'].epv]), Array(np.uint8), Array(np.float32), Array(np.float32), "
     "Array(np.uint32), Array(np.uint16), 'int64', 'int64']")
_add("dequantnf4.rows.f16.am32", "dequantnf4", "dequant_rows",
     "[Array(np.uint64), Array(np.uint8), Array(np.float32), Array(np.float32), Array(np.float16), 'int64', 'int64', "
     "'int64']")
# DequantAWQ: its one kernel (the former Variant DEFAULT; also FusedFFNAWQ's prefill route)
_add("dequantawq.default", "dequantawq", "make()", "SIG")

# MatMulNF4 (its ROUTES: python -m onnx_lowbit.custom_ops.runtime.routing): M=1 kernels m1.table16 / m1.pair (also
# fp16 A with ONNX_LOWBIT_FP32_DECODE=1), fp16 A m1.h2 / m1.h2wide, fast, generic; fp16: the two-row decode (m2) and
# nf4tc (one weight, rc 1 / 2; the two-weight kernel on the weight's halves from M = 8)
for _n, _d in _D.items():
    _m1 = (f"[Array({_d}), Array(np.uint64), Array(np.float32), Array(np.float32), Array({_d}), 'int32', "
           f"Array({_d}), 'int64', 'int64', 'int64']")
    _m1s = [("table16", "False, M1_MAX_REGISTERS, matmul=True, early=False, h2=0, wide=False"),
            ("pair", "True, M1_MAX_REGISTERS, matmul=True, early=True, h2=0, wide=False")]
    if _n == "f16":
        _m1s += [("h2", "False, M1_MAX_REGISTERS, matmul=True, early=False, h2=M1_H2, wide=False"),
                 ("h2wide", "False, M1_MAX_REGISTERS, matmul=True, early=False, h2=M1_H2_WIDE, wide=True")]
    for _k, _a in _m1s:
        _add(f"matmulnf4.m1.{_k}.{_n}", "matmulnf4", f"make_decode(1, False, {_a})", _m1)
    for _mode, _fn, _q in (("fast", "GEMV16", "np.uint64"), ("generic", "GENERIC", "np.uint8")):
        _add(f"matmulnf4.{_mode}.{_n}", "matmulnf4", _fn,
             f"[Array({_d}), Array({_q}), Array(np.float32), Array(np.float32), Array({_d}), 'int32', Array({_d}), "
             f"'int64', 'int64', 'int64', 'int64']")
_add("matmulnf4.m2.f16", "matmulnf4", "make_decode(2, False, False, None, matmul=True, h2=M1_H2_WIDE, wide=True)",
     "[Array(np.float16), Array(np.uint64), Array(np.float32), Array(np.float32), Array(np.float16), 'int32', "
     "Array(np.float16), 'int64', 'int64', 'int64', 'int64']")
# nf4tc (make(nw, warps, rc, halves)): warps_for(1) = WARPS 8, warps_for(2) = RC2_WARPS 4
for _nw, _h, _n in ((1, False, "nw1"), (2, True, "halves"), (2, False, "nw2")):
    for _rc, _wp in ((1, 8), (2, 4)):
        _add(f"nf4tc.{_n}.rc{_rc}", "nf4tc", f"make({_nw}, {_wp}, {_rc}, {_h})", "sig()")

# FusedFFNNF4 (its ROUTES): generic; the block decode variants of fusedffnnf4_cuda.DECODE (fp32 X: mt1 nib, mt2
# pair+early; fp16 X: wide chains of 4 with pingpong (mt1 also 3 groups, H100), mt1 chains of 2 below K 4096, mt1
# nib / mt2 pair with ONNX_LOWBIT_FP32_DECODE=1 or narrow K); nf4warp (WARPCOLS), nf4tc nw2 (above), nf4mma
for _a in (False, True):
    _add(f"fusedffnnf4.generic.{_T[_a]}", "fusedffnnf4", f"_make_generic({_a})", f"sig({_a}, True)")
_NF4_DECODE = [  # (a16, mt, name, pair, early, nib, h2, wide, pingpong, groups)
    (False, 1, "nib", False, False, True, 0, False, False, 1),
    (False, 2, "pair", True, True, False, 0, False, False, 1),
    (True, 1, "wide", False, False, False, 4, True, True, 1),
    (True, 1, "wide.g3", False, False, False, 4, True, True, 3),
    (True, 1, "h2", False, False, False, 2, False, False, 1),
    (True, 1, "nib", False, False, True, 0, False, False, 1),
    (True, 2, "wide", False, False, False, 4, True, True, 1),
    (True, 2, "pair", True, True, False, 0, False, False, 1),
]
for _a, _mt, _n, _p, _e, _nib, _h2, _wd, _pp, _g in _NF4_DECODE:
    _add(f"fusedffnnf4.decode.mt{_mt}.{_T[_a]}.{_n}", "fusedffnnf4",
         f"make_decode({_mt}, {_a}, {_p}, pingpong={_pp}, early={_e}, nib={_nib}, h2={_h2}, wide={_wd}, groups={_g})",
         f"sig({_a}, False, {_p})")
for (_m, _c), _split in (((1, 1), 1), ((2, 1), 1), ((1, 2), 1), ((2, 2), 2), ((1, 3), 1)):
    _add(f"nf4warp.mt{_m}.c{_c}.s{_split}", "nf4warp", f"_make({_c}, {_split}, {_m})", "sig(True, False, False)")
_add("nf4mma.nw2.mm4", "nf4mma", "make(WARPS)", "sig()")

# MatMulAWQ (nw 1) / FusedFFNAWQ (nw 2), awq/gemv_cuda: decode buckets (TUNED[nw]), generic; matmulawq1 (session
# config: unroll 4 / 2 / 1 by group size; one weight at M = 1: wpl 1 or 2; else wpl 1). The ids keep the op names
# of the kernels' former modules.
for _a in (False, True):
    for _nw, _op in ((1, "matmulawq"), (2, "fusedffnawq")):
        for _mt in ((1, 2, 4, 8) if _nw == 1 else (1, 2, 4)):
            _add(f"{_op}.decode.mt{_mt}.{_T[_a]}", "awqgemv", f"make_gemv({_mt}, {_a}, {_nw})",
                 f"sig({_a}, {_nw}, True)")
        _add(f"{_op}.generic.{_T[_a]}", "awqgemv", f"make_generic({_a}, {_nw})", f"sig({_a}, {_nw}, False)")
for _nw, _mr, _wpls in ((1, 1, (1, 2)), (1, 8, (1,)), (2, 1, (1,)), (2, 8, (1,))):
    for _u in (4, 2, 1):
        for _wpl in _wpls:
            _add(f"matmulawq1.nw{_nw}.mr{_mr}.u{_u}.wpl{_wpl}", "matmulawq1",
                 f"make(WARPS, {_u}, CONFIGS[{_wpl}][2], {_wpl}, {_nw}, {_mr})", f"sig({_wpl})")

# QuantGRU: the parameter kernel, the recurrent kernel (wide = bits 16; tn 1 / 2 / 4 by batch), xproj per tile of
# XTILES[bits] and (chunked: C > kc, wide: bits 16 or C >= 65536) as xproj_fn keys it
_add("quantgru.prep", "quantgru_prep", "prep", "signature()")
for _bits in (8, 16):       # quantgru_cuda.ROUTES: the xproj tiles, the recurrence per batch rows per thread (tn)
    _wdt = "np.int8" if _bits == 8 else "np.int16"
    for _tn in (1, 2, 4):
        _add(f"quantgru.rec.b{_bits}.tn{_tn}", "quantgru_rec", f"_make_rec({_bits == 16}, {_tn})", f"sig_rec({_wdt})")
    _cw = ((False, False), (True, False), (True, True)) if _bits == 8 else ((False, True), (True, True))
    for _tile in ("128x64", "64x64", "32x32"):
        for _ch, _wd in _cw:
            _add(f"quantgru.xproj.b{_bits}.{_tile}.c{int(_ch)}w{int(_wd)}", "quantgru_xproj",
                 f"_make_xproj({_bits}, xtile({_bits}, '{_tile}'), {_ch}, {_wd}, "
                 f"{'K_F32' if _bits == 8 else 'K_F64'})", f"sig_xproj({_wdt})")

NOT_COVERED = """\
Not snapshotted (no session routes them; benchmark / test entry points only):
  decode / tiled kernels under non-default ``variant=`` options (run(variant=...), tests and benchmarks)
  other dequantnf4 Variant options than the sessions' (DEFAULT; dequantnf4's LEGACY fallback is covered)
  fusedffnnf4 / nf4tc / nf4mma / nf4warp options other than the routed ones (cols, prefetch, max_registers, am16)"""


# ------------------------------------------------------------------------------------------------- normalising
_MANGLED = re.compile(r"_Z[A-Za-z0-9_$]+")
_ARRAYS = re.compile(r"\b_cudapy_([a-z]mem)_\d+\b")     # shared / local arrays: numbered per process
_PARAM = re.compile(r"^(.*?)(_param_\d+)$")
_DROP = (".version", ".file", ".loc")


def normalise(ptx: str) -> str:
    """PTX without what depends on the module path, the compile order or the toolkit build: mangled identifiers
    renamed SYM0, SYM1, ... in order of first appearance (a ``_param_k`` suffix stays), Numba's process-wide
    numbered array names (``_cudapy_smem_7``) SMEM0, LMEM1, ... likewise, comment lines, trailing comments and the
    ``.version`` / ``.file`` / ``.loc`` lines dropped, trailing blanks stripped."""
    names, arrays = {}, {}

    def array(m):
        if m.group(0) not in arrays:
            arrays[m.group(0)] = f"{m.group(1).upper()}{len(arrays)}"
        return arrays[m.group(0)]

    def canon(m):
        name, suffix = m.group(0), ""
        p = _PARAM.match(name)
        if p:
            name, suffix = p.group(1), p.group(2)
        if name not in names:
            names[name] = f"SYM{len(names)}"
        return names[name] + suffix

    out = []
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith("//") or s.startswith(_DROP):
            continue
        line = re.sub(r"\s*//.*$", "", line).rstrip()
        out.append(_ARRAYS.sub(array, _MANGLED.sub(canon, line)))
    return "\n".join(out) + "\n"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------------------------------------- compiling
OPTIONS = ("max_registers", "fastmath", "opt", "debug", "lineinfo", "forceinline", "launch_bounds", "lto",
           "extensions", "link")


def _module(alias):
    return importlib.import_module(f"{PACKAGE}.{MODULES[alias]}")


def _namespace(alias):
    """The module's names, with ``make_x`` / ``_make_x`` aliases for names the refactor may rename, plus Array and
    np for signature expressions."""
    import numpy as np
    ns = dict(vars(_module(alias)))
    for name in list(ns):       # a refactor may drop or add a leading underscore (``_make_x`` -> ``make_x``)
        if name.startswith("_") and not name.startswith("__"):
            ns.setdefault(name[1:], ns[name])
        elif not name.startswith("_"):
            ns.setdefault("_" + name, ns[name])
    ns["Array"] = _module("launch").Array
    ns["np"] = np
    return ns


def _types(signature):
    from numba import types
    return tuple(a.numba_type() if hasattr(a, "numba_type") else getattr(types, a) for a in signature)


def _options(fn):
    t = fn.targetoptions
    vals = []
    for k in OPTIONS:
        v = t.get(k)
        if k == "link" and v:
            v = [os.path.basename(str(p)) for p in v]
        vals.append(f"{k}={v!r}")
    return " ".join(vals)


def compile_variant(row):
    """(variant id, normalised PTX, kernel site, seconds, toolkit line) or (variant id, None, error text, seconds,
    None)."""
    vid, alias, factory, signature = row
    t0 = time.perf_counter()
    try:
        from numba import cuda
        ns = _namespace(alias)
        fn = eval(factory, ns)  # noqa: S307 - expressions from the table above
        if not hasattr(fn, "py_func") or not hasattr(fn, "targetoptions"):
            raise TypeError(f"{factory!r} is not a Numba CUDA kernel (got {type(fn).__name__})")
        if fn.targetoptions.get("device"):
            raise TypeError(f"{factory!r} is a device function, not a kernel")
        sig = _types(eval(signature, ns))  # noqa: S307
        opts = {k: fn.targetoptions[k] for k in ("fastmath", "opt", "debug", "lineinfo", "forceinline", "launch_bounds")
                if k in fn.targetoptions and k in inspect.signature(cuda.compile_ptx).parameters}
        ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=CC, **opts)
        text = f"// variant {vid}\n// options {_options(fn)}\n" + normalise(ptx)
        return vid, text, _site(fn, factory, ns), time.perf_counter() - t0, _toolkit(ptx)
    except Exception as e:  # noqa: BLE001 - reported per variant, the others still compile
        return vid, None, f"{type(e).__name__}: {e}", time.perf_counter() - t0, None


def _toolkit(ptx):
    """What the normalised text leaves out about the compiler: the header's build lines and ``.version``."""
    keep = [ln.strip("/ \t") for ln in ptx.splitlines()[:12] if ln.startswith("//") or ln.startswith(".version")]
    return " | ".join(k for k in keep if k)


def _site(fn, factory, ns):
    """(file, top-level name) the kernel was defined in; kernels from exec'd source: the factory's function."""
    code = fn.py_func.__code__
    if os.path.isfile(code.co_filename):
        return os.path.realpath(code.co_filename), fn.py_func.__qualname__.split(".")[0]
    head = re.match(r"[A-Za-z_]\w*", factory)
    obj = ns.get(head.group(0)) if head else None
    obj = getattr(obj, "__wrapped__", obj)
    if inspect.isfunction(obj):
        return os.path.realpath(obj.__code__.co_filename), obj.__name__
    return "?", "?"


def _worker_init():
    # numba.cuda must resolve to numba-cuda (its .pth redirector is not run when site-packages is reached through
    # another .pth, as in the worktree venvs) and the simulator must be off before numba is imported
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    try:
        import _numba_cuda_redirector  # noqa: F401
    except ImportError:
        pass


def kernel_sites(root):
    """(file, top-level name) of every kernel-level cuda.jit (a decorator or a call, without device=True) in the
    .py files under ``root``: what the table should cover."""
    sites = set()
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.realpath(os.path.join(dirpath, f))
            tree = ast.parse(open(path).read())
            for top in tree.body:
                for node in ast.walk(top):
                    if _is_kernel_jit(node):
                        sites.add((path, getattr(top, "name", "<module>")))
    return sites


def _is_kernel_jit(node):
    def jit(n):
        return isinstance(n, ast.Attribute) and n.attr == "jit" and isinstance(n.value, ast.Name) and \
            n.value.id == "cuda"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return any(jit(d) for d in node.decorator_list) or any(
            isinstance(d, ast.Call) and jit(d.func) and not _device_kw(d) for d in node.decorator_list)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and jit(node.func.func):
        return not _device_kw(node.func)     # cuda.jit(...)(fn)
    return False


def _device_kw(call):
    return any(k.arg == "device" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
               for k in call.keywords)


# ------------------------------------------------------------------------------------------------- commands
def select(only):
    rows = [r for r in VARIANTS if not only or re.search(only, r[0])]
    ids = [r[0] for r in VARIANTS]
    dup = {v for v in ids if ids.count(v) > 1}
    if dup:
        raise SystemExit(f"duplicate variant ids in the table: {sorted(dup)}")
    return rows


def snapshot(outdir, jobs, only):
    rows = select(only)
    if not rows:
        raise SystemExit(f"no variant matches --only {only!r}")
    outdir = os.path.abspath(outdir)
    if os.path.exists(outdir) and not os.path.isfile(os.path.join(outdir, "index.tsv")) and os.listdir(outdir):
        raise SystemExit(f"{outdir} exists and is not a snapshot (no index.tsv): not overwriting it")
    if os.environ.pop("NUMBA_ENABLE_CUDASIM", None) is not None:
        print("note: NUMBA_ENABLE_CUDASIM removed (compiling needs the real CUDA target)", file=sys.stderr)
    os.makedirs(os.path.dirname(outdir) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".ptx-snapshot-", dir=os.path.dirname(outdir) or ".")
    t0 = time.perf_counter()
    results, failed, sites, toolkits = {}, {}, set(), set()
    try:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=max(1, min(jobs, 2)), mp_context=ctx,
                                    initializer=_worker_init) as pool:
            for i, (vid, text, info, secs, tk) in enumerate(pool.map(compile_variant, rows), 1):
                if tk:
                    toolkits.add(tk)
                if text is None:
                    failed[vid] = info
                    print(f"[{i}/{len(rows)}] {vid}: FAILED {info}", flush=True)
                    continue
                sites.add(info)
                with open(os.path.join(tmp, f"{vid}.ptx"), "w") as f:
                    f.write(text)
                results[vid] = (digest(text), text.count("\n"), secs)
                print(f"[{i}/{len(rows)}] {vid}: {text.count(chr(10))} lines, {secs:.1f} s", flush=True)
        with open(os.path.join(tmp, "index.tsv"), "w") as f:
            f.write("variant\tsha256\tlines\n")
            for vid in sorted(results):
                f.write(f"{vid}\t{results[vid][0]}\t{results[vid][1]}\n")
        with open(os.path.join(tmp, TOOLCHAIN), "w") as f:
            f.write(f"numba {_version('numba')}, numba-cuda {_version('numba-cuda')}, cc {CC[0]}.{CC[1]}\n")
            f.write("".join(f"{t}\n" for t in sorted(toolkits)))
        if os.path.exists(outdir):
            shutil.rmtree(outdir)
        os.replace(tmp, outdir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    wall = time.perf_counter() - t0
    cpu = sum(r[2] for r in results.values())
    print(f"\n{len(results)} variants written to {outdir} in {wall:.0f} s wall ({cpu:.0f} s of compiling, "
          f"{min(jobs, 2)} workers)")
    slow = sorted(results.items(), key=lambda kv: -kv[1][2])[:5]
    print("slowest: " + ", ".join(f"{v} {r[2]:.1f} s" for v, r in slow))
    if not only:
        report_sites(sites)
    if failed:
        print(f"\n{len(failed)} variants FAILED (not in the snapshot):")
        for vid, err in failed.items():
            print(f"  {vid}: {err}")
        return 2
    return 0


def report_sites(covered):
    spec = importlib.util.find_spec(PACKAGE)
    root = os.path.realpath(list(spec.submodule_search_locations)[0])
    found = kernel_sites(root)
    missing = sorted(found - covered)
    print(f"kernel sites (cuda.jit kernels by defining function) under {root}: {len(found)}, "
          f"covered {len(found & covered)}")
    for path, name in missing:
        print(f"  not covered: {os.path.relpath(path, root)}:{name}")


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _read_toolchain(d):
    path = os.path.join(d, TOOLCHAIN)
    return " / ".join(open(path).read().splitlines()) if os.path.isfile(path) else "(not recorded)"


def read_index(d):
    path = os.path.join(d, "index.tsv")
    if not os.path.isfile(path):
        raise SystemExit(f"{d} is not a snapshot (no index.tsv)")
    rows = {}
    with open(path) as f:
        for line in f.read().splitlines()[1:]:
            vid, sha, n = line.split("\t")
            rows[vid] = (sha, int(n))
    return rows


def compare(a, b, diffs=3, out=None):
    """Prints identical / changed / missing per variant and unified diffs of the first ``diffs`` changed ones;
    returns 0 when both snapshots hold the same variants with the same PTX, else 1."""
    out = out or sys.stdout
    ia, ib = read_index(a), read_index(b)
    ta, tb = (_read_toolchain(d) for d in (a, b))
    if ta != tb:
        print(f"note: the snapshots come from different compilers, so differences need not come from the code:\n"
              f"  A: {ta}\n  B: {tb}\n", file=out)
    status = {}
    for vid in sorted(set(ia) | set(ib)):
        if vid not in ib:
            status[vid] = "missing in B"
        elif vid not in ia:
            status[vid] = "missing in A"
        else:
            status[vid] = "identical" if ia[vid][0] == ib[vid][0] else "changed"
    width = max([len(v) for v in status] + [7])
    print(f"{'variant':<{width}}  {'status':<12}  lines A  lines B", file=out)
    for vid, st in status.items():
        la = ia[vid][1] if vid in ia else "-"
        lb = ib[vid][1] if vid in ib else "-"
        print(f"{vid:<{width}}  {st:<12}  {la:>7}  {lb:>7}", file=out)
    counts = {s: list(status.values()).count(s) for s in ("identical", "changed", "missing in A", "missing in B")}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()), file=out)
    changed = [v for v, s in status.items() if s == "changed"]
    for vid in changed[:diffs]:
        ta = open(os.path.join(a, f"{vid}.ptx")).read().splitlines()
        tb = open(os.path.join(b, f"{vid}.ptx")).read().splitlines()
        diff = list(difflib.unified_diff(ta, tb, f"A/{vid}.ptx", f"B/{vid}.ptx", lineterm="", n=3))
        print(f"\n--- diff of {vid} ({len(diff)} lines{', first 200' if len(diff) > 200 else ''})", file=out)
        print("\n".join(diff[:200]), file=out)
    return 0 if counts["identical"] == len(status) else 1


def list_table():
    _worker_init()
    for vid, alias, factory, signature in select(None):
        print(f"{vid}\t{MODULES[alias]}\t{factory}\t{signature}")
    print(f"\n{len(VARIANTS)} variants\n\n{NOT_COVERED}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("outdir", nargs="?", help="snapshot directory to write")
    p.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"))
    p.add_argument("--diffs", type=int, default=3, help="unified diffs of the first N changed variants")
    p.add_argument("--list", action="store_true", help="print the variant table")
    p.add_argument("--only", help="compile only variants whose id matches this regular expression")
    p.add_argument("-j", "--jobs", type=int, default=2, help="compiling processes (at most 2)")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare, diffs=args.diffs)
    if args.list:
        list_table()
        return 0
    if not args.outdir:
        p.error("give OUTDIR, --compare DIR_A DIR_B or --list")
    return snapshot(args.outdir, args.jobs, args.only)


if __name__ == "__main__":
    sys.exit(main())
