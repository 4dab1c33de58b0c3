"""Options and the quantisers' calls of the weights4 pass (passes/weights4.py): the validated options, the formats'
quantisers run a column chunk at a time, onnxruntime's MatMulNBits layout, and the AWQ scale search's figures for
the report."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from onnx_lowbit.matmulnbits import ORT_BLOCK_SIZES

from . import weights4_graph as w4g
from .linear import Linear, Skip


FORMATS = ("nf4", "fp4", "awq")
ROUNDINGS = ("rtn", "gptq")          # round to nearest; GPTQ's error-compensating rounding (onnx_lowbit.gptq)
BUDGET_FORMS = ("int8", "fp16")      # the higher precision a budget keeps sensitive products in (weights4_mixed)
LM_HEAD = ("fp16", "float", "4bit")  # the output head over a vocabulary: fp16 (float32 models), as is, quantised
DEFAULT_AWQ_HOLDOUT = 0.25  # the last quarter of the calibration rows: AWQ's scales must beat RTN there too
TARGETS = ("lowbit", "ort")
MS_DOMAIN = "com.microsoft"
DEFAULT_BLOCK_SIZE = 64
DEFAULT_GROUP_SIZE = 128
DEFAULT_MIN_ELEMENTS = 4096
MAX_GROUP_SIZE = 1 << 16             # the MatMulAWQ kernels' limit
MAX_CALIBRATION_ROWS = 8192          # activation rows per MatMul handed to the AWQ search (evenly subsampled)
CHUNK_ELEMENTS = 1 << 22             # weight elements quantised at a time (column chunks; bounds the temporaries)


# ---------------------------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Options:
    fmt: str
    target: str = "lowbit"
    block_size: int = DEFAULT_BLOCK_SIZE
    group_size: int = DEFAULT_GROUP_SIZE
    min_elements: int = DEFAULT_MIN_ELEMENTS
    exclude: list = field(default_factory=list)  # (pattern string, compiled regex)
    calibration: dict | None = None
    checkpoint: object = None  # onnx_lowbit.awq_checkpoint.Checkpoint: AWQ weights taken from it, not quantised
    module_paths: dict = field(default_factory=dict)  # node name -> source module path (dynamo exports)
    calibration_session: object = None
    lm_head: str = "fp16"  # LM_HEAD: how the output head over a vocabulary is stored
    awq_holdout: float = DEFAULT_AWQ_HOLDOUT
    spill: object = None   # callable(name, array) -> external TensorProto (streaming, see passes/external.py)
    ort_form: str = "awq"  # target "ort", weights awq: "awq" (zero points, AWQ's RTN) or "compact" (nbits_compact.py)
    ort_accuracy: int | None = None  # target "ort", weights awq: MatMulNBits' accuracy_level (None: not written, 0)
    nf4_accuracy: int | None = None  # target "lowbit", weights nf4/fp4: MatMulNF4's accuracy_level (None: not written)
    target_why: str = ""   # why this target (e.g. the --device cpu default: onnx_lowbit/cpu_passes.py), for the report
    rounding: str = "rtn"  # ROUNDINGS
    gptq_damp: float = 0.01
    budget: float | None = None   # total weight bytes <= budget x the fp32 bytes of the model's float constants
    budget_form: str = "int8"     # BUDGET_FORMS


def _int_option(options: dict, key: str, default: int) -> int:
    v = options.get(key)
    if v is None:
        return default
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{key} must be an integer, got {v!r}")
    return int(v)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def parse_options(options: dict) -> Options | None:
    """The pass's options, validated (ValueError naming the option); None when ``weights`` is not given."""
    fmt = options.get("weights")
    ckpt = options.get("awq_checkpoint")
    if ckpt is not None and fmt is None:
        fmt = "awq"
    if fmt is None:
        return None
    if not isinstance(fmt, str) or fmt.lower() not in FORMATS:
        raise ValueError(f"weights: unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    o = Options(fmt=fmt.lower())
    target = options.get("weights_target") or "lowbit"
    if not isinstance(target, str) or target.lower() not in TARGETS:
        raise ValueError(f"weights_target: unknown target {target!r}; one of {', '.join(TARGETS)}")
    o.target = target.lower()
    o.block_size = _int_option(options, "block_size", DEFAULT_BLOCK_SIZE)
    if o.fmt in ("nf4", "fp4"):
        if not (_pow2(o.block_size) and 32 <= o.block_size <= 4096):
            raise ValueError(f"block_size: {o.block_size} is not a power of two in 32..4096")
        if o.target == "ort" and o.block_size not in ORT_BLOCK_SIZES:
            raise ValueError(f"block_size: {o.block_size} is not supported by onnxruntime's MatMulBnb4 "
                             f"(weights_target='ort'): one of {', '.join(str(b) for b in ORT_BLOCK_SIZES if b >= 32)}")
    o.group_size = _int_option(options, "group_size", _int_option(options, "block_size", DEFAULT_GROUP_SIZE))
    if o.fmt == "awq":
        if not 1 <= o.group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"group_size: {o.group_size} is not in 1..{MAX_GROUP_SIZE} (K is zero-padded up to a "
                             "multiple of the group size, so any size in that range divides it)")
        if o.target == "ort" and o.group_size not in ORT_BLOCK_SIZES:
            raise ValueError(f"group_size: {o.group_size} is not supported by onnxruntime's MatMulNBits "
                             f"(weights_target='ort'): one of {', '.join(map(str, ORT_BLOCK_SIZES))}")
    _ort_form(o, options, ckpt)
    o.ort_accuracy = _ort_accuracy(o, options)
    o.nf4_accuracy = _nf4_accuracy(o, options)
    o.target_why = str(options.get("weights_target_why") or "")
    o.min_elements = _int_option(options, "weights_min_elements", DEFAULT_MIN_ELEMENTS)
    if o.min_elements < 0:
        raise ValueError(f"weights_min_elements: {o.min_elements} must be >= 0")
    exclude = options.get("weights_exclude") or []
    if isinstance(exclude, str):
        exclude = [exclude]
    for pat in exclude:
        if not isinstance(pat, str) or not pat:
            raise ValueError(f"weights_exclude: {pat!r} is not a name or regular expression")
        try:
            rx = re.compile(pat)
        except re.error as e:
            raise ValueError(f"weights_exclude: {pat!r} is not a valid regular expression ({e})") from None
        o.exclude.append((pat, rx))
    _quality_options(o, options)
    cal = options.get("calibration")
    if cal is not None:
        if o.fmt != "awq" and o.rounding != "gptq" and o.budget is None:
            raise ValueError(f"calibration: only used by weights='awq', weights_rounding='gptq' or weights_budget "
                             f"(weights={o.fmt!r})")
        if not isinstance(cal, dict) or not cal:
            raise ValueError("calibration: expected a non-empty dict {graph input name: numpy array}")
        o.calibration = {str(k): np.asarray(v) for k, v in cal.items()}
    if cal is None and (o.rounding == "gptq" or o.budget is not None):
        raise ValueError(f"{'weights_rounding' if o.rounding == 'gptq' else 'weights_budget'}: needs calibration "
                         "activations (option calibration / --calibration FILE.npz)")
    if ckpt is not None and (o.rounding == "gptq" or o.budget is not None):
        raise ValueError("awq_checkpoint: its weights are taken as they are; weights_rounding='gptq' and "
                         "weights_budget do not apply")
    if ckpt is not None:
        if o.fmt != "awq":
            raise ValueError(f"awq_checkpoint: an AutoAWQ checkpoint gives AWQ weights, not weights={o.fmt!r}")
        from onnx_lowbit.awq_checkpoint import Checkpoint  # noqa: PLC0415
        o.checkpoint = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt)
    head = options.get("weights_lm_head") or "fp16"
    if head not in LM_HEAD:
        raise ValueError(f"weights_lm_head: {head!r} is not one of {', '.join(LM_HEAD)}")
    o.lm_head = head
    hold = options.get("awq_holdout", DEFAULT_AWQ_HOLDOUT)
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold < 1:
        raise ValueError(f"awq_holdout: {hold!r} is not a fraction in [0, 1)")
    o.awq_holdout = float(hold)
    o.module_paths = dict(options.get("module_paths") or {})
    o.calibration_session = options.get("calibration_session")
    o.spill = options.get("spill")
    return o


def _ort_form(o: Options, options: dict, ckpt) -> None:
    """The option ``weights_ort_form`` ("awq" default, or "compact": passes/nbits_compact.py), validated; compact
    sets the group size to nbits_compact.COMPACT_BLOCK unless group_size / block_size is given."""
    from .nbits_compact import COMPACT_BLOCK, FORMS  # noqa: PLC0415
    form = options.get("weights_ort_form") or "awq"
    if form not in FORMS:
        raise ValueError(f"weights_ort_form: {form!r} is not one of {', '.join(FORMS)}")
    if form == "compact":
        if o.target != "ort" or o.fmt != "awq":
            raise ValueError("weights_ort_form: 'compact' is a form of onnxruntime's MatMulNBits: it needs "
                             "weights='awq' and weights_target='ort'")
        if ckpt is not None or options.get("calibration") is not None:
            raise ValueError("weights_ort_form: 'compact' quantises round-to-nearest, symmetric: not with an AWQ "
                             "checkpoint or calibration")
        if options.get("group_size") is None and options.get("block_size") is None:
            o.group_size = COMPACT_BLOCK
    o.ort_form = form


ORT_ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits' accuracy_level: 4 = int8 activations (MLAS' VNNI / AVX2 kernels)


def _nf4_accuracy(o: Options, options: dict) -> int | None:
    """The option ``weights_nf4_accuracy`` (our MatMulNF4's ``accuracy_level``, 0..4: 4 = int8 activations on the CPU,
    onnx_lowbit.nf4_int8), validated: only with weights nf4 / fp4 and weights_target 'lowbit'."""
    if options.get("weights_nf4_accuracy") is None:
        return None
    from onnx_lowbit import nf4_int8  # noqa: PLC0415
    level = _int_option(options, "weights_nf4_accuracy", 0)
    if level not in nf4_int8.LEVELS:
        raise ValueError(f"weights_nf4_accuracy: {level} is not one of {', '.join(map(str, nf4_int8.LEVELS))} "
                         "(MatMulNF4's accuracy_level)")
    if o.target != "lowbit" or o.fmt not in ("nf4", "fp4"):
        raise ValueError("weights_nf4_accuracy: MatMulNF4's accuracy_level needs weights='nf4' or 'fp4' and "
                         f"weights_target='lowbit' (got weights={o.fmt!r}, weights_target={o.target!r}; "
                         "weights_ort_accuracy is MatMulNBits')")
    return level


def _ort_accuracy(o: Options, options: dict) -> int | None:
    """The option ``weights_ort_accuracy`` (MatMulNBits' ``accuracy_level``, 0..4), validated: only with
    weights='awq' and weights_target='ort' (MatMulBnb4, the ort target of nf4 / fp4, has no such attribute)."""
    v = options.get("weights_ort_accuracy")
    if v is None:
        return None
    level = _int_option(options, "weights_ort_accuracy", 0)
    if level not in ORT_ACCURACY_LEVELS:
        raise ValueError(f"weights_ort_accuracy: {level} is not one of {', '.join(map(str, ORT_ACCURACY_LEVELS))} "
                         "(MatMulNBits' accuracy_level)")
    if o.target != "ort" or o.fmt != "awq":
        raise ValueError("weights_ort_accuracy: MatMulNBits' accuracy_level needs weights='awq' and "
                         f"weights_target='ort' (got weights={o.fmt!r}, weights_target={o.target!r}; MatMulBnb4, "
                         "the ort target of nf4 / fp4, has no accuracy level)")
    return level


def _quality_options(o: Options, options: dict) -> None:
    """weights_rounding, gptq_damp, weights_budget, weights_budget_form (ValueError naming the option)."""
    rounding = options.get("weights_rounding") or "rtn"
    if not isinstance(rounding, str) or rounding.lower() not in ROUNDINGS:
        raise ValueError(f"weights_rounding: {rounding!r} is not one of {', '.join(ROUNDINGS)}")
    o.rounding = rounding.lower()
    damp = options.get("gptq_damp", 0.01)
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 <= damp <= 1:
        raise ValueError(f"gptq_damp: {damp!r} is not a fraction in [0, 1]")
    o.gptq_damp = float(damp)
    budget = options.get("weights_budget")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
            raise ValueError(f"weights_budget: {budget!r} is not a fraction in (0, 1] of the model's fp32 weight "
                             "bytes")
        o.budget = float(budget)
    form = options.get("weights_budget_form") or "int8"
    if form not in BUDGET_FORMS:
        raise ValueError(f"weights_budget_form: {form!r} is not one of {', '.join(BUDGET_FORMS)}")
    o.budget_form = form


# ---------------------------------------------------------------------------------------------------------------
# the formats (imported lazily: the pass registry must import without them)
# ---------------------------------------------------------------------------------------------------------------
def _nf4():
    from onnx_lowbit import nf4  # noqa: PLC0415
    return nf4


def _awq():
    from onnx_lowbit import awq  # noqa: PLC0415
    return awq


def nbits_layout(qweight, qzeros, scales, K: int, group_size: int, dtype, n: int | None = None):
    """AutoAWQ (qweight int32 [Kp, N/8], qzeros int32 [Kp/G, N/8], scales fp16 [Kp/G, N]) -> the inputs of
    com.microsoft.MatMulNBits (bits=4, block_size=G): B uint8 [N, Kp/G, G/2] (element k of a block in byte k//2,
    even k in the low nibble), scales [N * Kp/G] in A's dtype, zero_points uint8 [N * ceil((Kp/G)/2)] (block j of
    row n in byte n*ceil(nb/2) + j//2, even j in the low nibble). Rows past K are ignored by MatMulNBits."""
    q, z = _awq().unpack(qweight, qzeros)         # uint8 [Kp, N], [nb, N]
    if n is not None:                             # AWQ's zero columns past the weight's N (MatMulNBits takes any N)
        q, z, scales = q[:, :n], z[:, :n], np.asarray(scales)[:, :n]
    kp, n = q.shape
    nb = kp // group_size
    qt = q.T.reshape(n, nb, group_size)
    b = (qt[:, :, 0::2] | (qt[:, :, 1::2] << 4)).astype(np.uint8)
    zt = z.T                                      # [N, nb]
    zbytes = (nb + 1) // 2
    zpad = np.zeros((n, 2 * zbytes), np.uint8)
    zpad[:, :nb] = zt
    zp = (zpad[:, 0::2] | (zpad[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    sc = np.asarray(scales).T.astype(dtype).reshape(-1)
    return np.ascontiguousarray(b), sc, zp


def _format_call(fn, *args):
    """A quantiser of onnx_lowbit.nf4 / awq; its ValueError (e.g. NaN/Inf weights) skips the weight."""
    try:
        return fn(*args)
    except ValueError as e:
        raise Skip(f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__} refused the weight: {e}") from None


def _rel_fro(w: np.ndarray, w_hat: np.ndarray) -> float:
    w = np.asarray(w, np.float64)
    d = np.linalg.norm(w - np.asarray(w_hat, np.float64))
    n = np.linalg.norm(w)
    return float(d / n) if n > 0 else float(d)


def _column_chunks(k: int, n: int, multiple: int):
    """[n0, n1) column ranges of about CHUNK_ELEMENTS weight elements, each a multiple of ``multiple`` wide
    (the last may be shorter): the formats quantise columns independently, so chunked results are the same bytes."""
    step = max(multiple, (CHUNK_ELEMENTS // max(k, 1)) // multiple * multiple)
    for n0 in range(0, n, step):
        yield n0, min(n, n0 + step)


def _columns(cand: "Linear", n0: int, n1: int) -> np.ndarray:
    """Columns n0..n1 of the effective [K, N] weight in float32 (alpha folded), as ``cand.w`` would give them."""
    v = cand.value[n0:n1, :].T if cand.transpose else cand.value[:, n0:n1]
    w = np.ascontiguousarray(v, dtype=np.float32)
    return w * np.float32(cand.alpha) if cand.alpha != 1.0 else w


def _sq_err(w: np.ndarray, w_hat: np.ndarray) -> tuple:
    w = np.asarray(w, np.float64)
    return float(np.sum(np.square(w - np.asarray(w_hat, np.float64)))), float(np.sum(np.square(w)))


def _rel_from(err2: float, ref2: float) -> float:
    return float(np.sqrt(err2) / np.sqrt(ref2)) if ref2 > 0 else float(np.sqrt(err2))


def quantize_nf4_chunked(cand: "Linear", fmt: str, block_size: int):
    """(packed uint8 flat, absmax float32 flat, relative reconstruction error) of cand's weight, quantised
    CHUNK_ELEMENTS at a time (the same bytes as nf4.quantize of the whole weight)."""
    nf4 = _nf4()
    k, n = int(cand.K), int(cand.N)
    packs, maxes, err2, ref2 = [], [], 0.0, 0.0
    for n0, n1 in _column_chunks(k, n, block_size // np.gcd(k, block_size)):
        w = _columns(cand, n0, n1)
        packed, absmax = _format_call(nf4.quantize, w, fmt, block_size)
        packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
        absmax = np.ascontiguousarray(absmax, dtype=np.float32).reshape(-1)
        e, r = _sq_err(w, nf4.dequantize(packed, absmax, fmt, block_size, k, n1 - n0))
        packs.append(packed)
        maxes.append(absmax)
        err2, ref2 = err2 + e, ref2 + r
    return np.concatenate(packs), np.concatenate(maxes), _rel_from(err2, ref2)


def quantize_rtn_chunked(cand: "Linear", group_size: int):
    """(qweight, qzeros, scales, relative reconstruction error) of AWQ round-to-nearest on cand's weight,
    CHUNK_ELEMENTS at a time (columns in multiples of 8: the same arrays as awq.quantize_rtn of the whole; an N
    not a multiple of 8 gets zero columns up to the next one: N + w4g.padding(N) columns)."""
    awq = _awq()
    k, n = int(cand.K), int(cand.N)
    parts, err2, ref2 = [], 0.0, 0.0
    for n0, n1 in _column_chunks(k, n, 8):
        w = _columns(cand, n0, n1)
        extra = w4g.padding(n1 - n0)   # the last chunk of an N not a multiple of 8: zero columns (quantised to 0)
        qw, qz, sc = _format_call(awq.quantize_rtn, w4g.pad_columns(w, extra), group_size)
        e, r = _sq_err(w, awq.dequantize(qw, qz, sc, group_size, k, n1 - n0 + extra)[:, :n1 - n0])
        parts.append((np.asarray(qw, np.int32), np.asarray(qz, np.int32), np.asarray(sc, np.float16)))
        err2, ref2 = err2 + e, ref2 + r
    qweight, qzeros, scales = (np.concatenate([p[i] for p in parts], axis=1) for i in range(3))
    return qweight, qzeros, scales, _rel_from(err2, ref2)


def _search_details(found) -> dict:
    """The AWQ search's figures for the report (output MSE on the rows searched and on the held-out rows) and a
    one-line note ("search")."""
    d = dict(awq_alpha=found.alpha, calib_mse_rtn=found.err_rtn, calib_mse_awq=found.err_awq,
             heldout_mse_rtn=found.holdout_rtn, heldout_mse_awq=found.holdout_awq)
    if found.holdout_rtn is None:
        held = "no held-out rows (awq_holdout=0, or fewer than 8 calibration rows)"
    else:
        held = f"held-out output MSE {found.holdout_awq:.3g} vs RTN {found.holdout_rtn:.3g}"
    if found.alpha:
        d["search"] = f"AWQ scales alpha {found.alpha:.2f}: {held}"
    elif found.holdout_awq is not None and found.holdout_awq > found.holdout_rtn:
        d["search"] = f"RTN kept: the searched scales lost on the held-out rows ({held})"
    else:
        d["search"] = f"RTN kept: no searched scale beat it on the calibration rows ({held})"
    return d


def _usable_act(found, k: int, dtype) -> tuple:
    """(act_scale = 1 / s as float32 rounded to the model's float type, or None for RTN; the weight rows' scale:
    s for float32 models, 1 / act_scale for fp16 ones (the model applies act rounded to fp16: the pair is then
    exact); a note when the searched scales cannot be used)."""
    if not found.alpha:
        return None, None, None
    act = (np.float32(1.0) / np.asarray(found.scales, np.float32)).reshape(-1)
    with np.errstate(over="ignore", divide="ignore"):
        act_model = act.astype(dtype)
        ok = (act.size == k and np.all(np.isfinite(act)) and np.all(act > 0) and np.all(np.isfinite(act_model))
              and np.all(act_model > 0))
    if not ok:
        return None, None, ("AWQ search gave unusable activation scales (non-finite, <= 0 or outside the model's "
                            "float range): RTN instead")
    if dtype is np.float32 or np.array_equal(act_model.astype(np.float32), act):
        return act, np.asarray(found.scales, np.float32).reshape(-1), None
    act = act_model.astype(np.float32)
    return act, np.float32(1.0) / act, None


# ---------------------------------------------------------------------------------------------------------------
# GPTQ rounding (weights_rounding="gptq"; onnx_lowbit.gptq)
# ---------------------------------------------------------------------------------------------------------------
def hessians(cache: dict, name: str, x: np.ndarray, holdout: float) -> tuple:
    """(H of the rows GPTQ fits, H of the held-out rows or None) of the activations x of tensor ``name``, computed
    once per tensor (q/k/v, gate/up share them). The held-out rows are the same as AWQ's (``awq_holdout``)."""
    if name not in cache:
        from onnx_lowbit import gptq  # noqa: PLC0415
        fit, held = _awq().split_holdout(x, holdout) if holdout else (x, None)
        cache[name] = (gptq.hessian(fit), gptq.hessian(held) if held is not None else None, {})
    return cache[name]


def _mse(h: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float:
    """mean((X (W - W_hat))^2) from H = X^T X / rows."""
    d = np.asarray(w, np.float64) - np.asarray(w_hat, np.float64)
    return float(np.sum(d * (h @ d)) / d.shape[1])


def gptq_round(o: Options, w: np.ndarray, hs: tuple, act: np.ndarray | None = None):
    """GPTQ rounding of w [K, N] (float32; AWQ: N a multiple of 8, already times AWQ's s rows when ``act`` = 1 / s
    is given: the activations are then x * act) compared with round-to-nearest on the same grid. Returns (the
    gptq result, or None when RTN is kept: GPTQ lost on the held-out rows, or the grid does not allow it;
    details for the report; a note)."""
    from onnx_lowbit import gptq  # noqa: PLC0415
    h, hh, factors = hs
    if act is not None:
        a = np.asarray(act, np.float64)
        h = h * a[:, None] * a[None, :]
        hh = None if hh is None else hh * a[:, None] * a[None, :]
    k = w.shape[0]
    got = factors.get(id(act))       # products reading one input with one scale (q/k/v, gate/up) share U
    if got is None or got[0] is not act:
        got = factors[id(act)] = (act, _format_call(gptq.inverse_cholesky, h, o.gptq_damp))
    u = got[1]
    if o.fmt == "awq":
        res = _format_call(gptq.gptq_awq, w, h, o.group_size, o.gptq_damp, u)
        rtn = _awq().fake_quantize(w, o.group_size)
    else:
        if k % o.block_size:
            return None, {}, (f"GPTQ not applied: K = {k} is not a multiple of block_size {o.block_size} "
                              "(bitsandbytes' blocks would run across columns): RTN")
        res = _format_call(gptq.gptq_nf4, w, h, o.fmt, o.block_size, o.gptq_damp, u)
        packed, absmax = _nf4().quantize(w, o.fmt, o.block_size)
        rtn = _nf4().dequantize(packed, absmax, o.fmt, o.block_size, k, w.shape[1])
    d = dict(gptq_mse_fit=_mse(h, w, res.w_hat), rtn_mse_fit=_mse(h, w, rtn),
             gptq_mse_heldout=None if hh is None else _mse(hh, w, res.w_hat),
             rtn_mse_heldout=None if hh is None else _mse(hh, w, rtn))
    fit = f"calibration output MSE {d['gptq_mse_fit']:.3g} vs RTN {d['rtn_mse_fit']:.3g}"
    if hh is None:
        return res, d, f"GPTQ rounding: {fit} (no held-out rows)"
    held = f"held-out {d['gptq_mse_heldout']:.3g} vs RTN {d['rtn_mse_heldout']:.3g}"
    if d["gptq_mse_heldout"] > d["rtn_mse_heldout"]:
        d["gptq_kept"] = False
        return None, d, f"RTN kept: GPTQ lost on the held-out rows ({fit}; {held})"
    d["gptq_kept"] = True
    return res, d, f"GPTQ rounding: {fit}; {held}"
