"""The kernel object MatMulAWQ (one weight) and FusedFFNAWQ (two: ffn/fusedffnawq_cuda) share: the routing
conditions of their ROUTES tables, the kernels a node compiles, and one launch per call of the kernel its op's
ROUTES names for the call's Case.

Kernels (routing names): ``gemv1`` / ``gemv8``, the small-M tensor-core GEMV (matmulawq1_cuda) at M = 1 and at
M = 2 .. 16 (chunks of 8 rows); ``decode``, the fp32-accumulating decode kernel for M <= 16 (gemv_cuda.make_gemv);
``generic``, any M (gemv_cuda.make_generic). A Case's ``aligned``: X and the scales 8-byte aligned, qweight and
qzeros to the GEMV's words (8 bytes where this node's M = 1 plan loads two per lane); the alignment every kernel
needs (X, the biases and the output to their element, qweight / qzeros to 4 bytes, scales to 2) is an input
check before routing.

Split-K memory (gemv_cuda's docstring): the partials come per call from onnxruntime's allocator
(``Context.scratch``), the tile counters are the node's own per stream (``splitk.ScratchPool``, sized at creation
for every kernel the node can route to).
"""
from __future__ import annotations

from ..device.splitk import ScratchPool, partial_floats
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, route
from . import matmulawq1_cuda as m1
from .dequantawq_cpu import parse_attrs
from .gemv_cuda import BLOCK, CT, MAX_M_FAST, WARPS, blocks_per_sm, bucket, decode_plan, launcher
from ..device.host import sm_count
from .common_cuda import has_tc


# ------------------------------------------------------------------------------- routing conditions (both ops)
def gemv_takes(c):
    """fp16 X on a GPU with tensor cores, a shape the small-M GEMV takes, aligned for it."""
    return c.dtype == "float16" and c.tc and c.aligned and m1.takes(c.k, c.bs)


def gemv1(c):
    return c.m == 1 and gemv_takes(c)


def gemv8(c):
    return 2 <= c.m <= m1.MAX_M and gemv_takes(c)


def decode(c):
    return c.m <= MAX_M_FAST


GEMV_WHEN = ("fp16 X, tensor cores (cc >= 8.0), K % 4 == 0, group_size % 16 == 0, X and scales 8-byte aligned "
             "(qweight / qzeros too where the M = 1 plan loads 8-byte words)")


ROUTES = (
    Route("gemv1", f"M = 1, {GEMV_WHEN}", gemv1,
          "BENCHMARKS.md 'AWQ int4 (MatMulAWQ, FusedFFNAWQ)'; docs/lab-log.md session 23 (2026-11-26)"),
    Route("gemv8", f"M = 2 .. 16, {GEMV_WHEN}", gemv8,
          "docs/lab-log.md session 24, later (M = 2 .. 8, commit cf5144f) and session 26 (M = 9 .. 16, commit "
          "29c92e2: against the older tensor-core kernel)"),
    Route("decode", "M = 1 .. 16 (fp32 X, or a shape / buffer the GEMV cannot take)", decode,
          "docs/lab-log.md '2026-11-24: AWQ decode kernels with 32-bit decoding'"),
    Route("generic", "M > 16", always, "none: correctness route past M = 16 where the ops' prefill routes (placed "
          "before it in MatMulAWQ's and FusedFFNAWQ's tables) do not take the call: fp32 X, no cuBLAS, no scratch"),
)
"""The routing table of both AWQ decode ops (MatMulAWQ with one weight, FusedFFNAWQ with two read in the same
pass): the same kernels with ``nw`` 1 or 2, measured together."""


def reachable(routes, dtype, k, n, g_size, tc):
    """The kernel names ``routes`` gives some call of a node (A's type ``dtype``, K, N, group size, tensor cores):
    every M up to MAX_M_FAST + 1, aligned or not."""
    return {route(routes, Case(dtype, m, k, n, aligned=al, tc=tc, bs=g_size)).kernel
            for m in range(1, MAX_M_FAST + 2) for al in (True, False)}


# --------------------------------------------------------------------------------------------- kernel object
class AWQDecodeKernel(Kernel):
    """Base of the MatMulAWQ / FusedFFNAWQ CUDA kernels: ``NW`` weights, ``ROUTES`` the op's table; the subclass's
    ``operands`` checks a call's inputs."""
    native_plans = True  # launches depend only on shapes; partials per call, per-stream counters live as long as it
    NW = 1
    ROUTES = ROUTES

    def __init__(self, **kw):
        super().__init__(**kw)
        sh = self.sh = parse_attrs(self.attrs)
        self.a16 = self.in_types[0] == 10
        self.dtype = "float16" if self.a16 else "float32"
        self.tc = has_tc()
        sms = sm_count()
        self.tiles = -(-sh.NG // CT)
        # compile now (once per process and A type) every kernel a call of this node can route to, never on the
        # hot path; plan every M the decode kernels take from their occupancy
        names = reachable(self.ROUTES, self.dtype, sh.K, sh.N, sh.group_size, self.tc)
        self.gemv = {mr: m1.session_setup(sh, sms, self.NW, mr) for name, mr in (("gemv1", 1), ("gemv8", 8))
                     if name in names}
        self.decode = {mt: launcher(self.a16, mt, self.NW) for mt in dict.fromkeys(
            bucket(m, self.NW) for m in range(1, MAX_M_FAST + 1))}
        self.generic = launcher(self.a16, None, self.NW)
        self.plans = {m: decode_plan(m, sh.K, sh.N, sh.group_size, sms, blocks_per_sm(self.decode[bucket(m, self.NW)]),
                                     self.NW) for m in range(1, MAX_M_FAST + 1)}
        # split-K partials: per call from onnxruntime's allocator (the pool's, sized for the largest call, only for
        # onnxruntime < 1.18); tile counters: the pool's, one set per CUDA stream
        sizes = [(partial_floats(splits, self.NW, m, sh.N), self.tiles) for m, (_, _, splits) in self.plans.items()]
        sizes += [sp.scratch(sh.N) for sp in self.gemv.values()]
        self.scratch = ScratchPool(max(s for s, _ in sizes), max(t for _, t in sizes))
        self.launch = {"gemv1": self._gemv, "gemv8": self._gemv, "decode": self._decode, "generic": self._generic}

    def operands(self, inputs):
        """(X, [weights (qweight, qzeros, scales) per weight], [bias or None per weight], M), the inputs
        checked (KernelError naming the input)."""
        raise NotImplementedError

    def case(self, m, x, ws, scratch=True):
        """The routing Case of a call at M = m with X and the weights ``ws`` (bridge Tensors); ``scratch``: the call
        has onnxruntime's scratch (read by FusedFFNAWQ's prefill row)."""
        wpl = self.gemv[1].wpl if m == 1 and 1 in self.gemv else 1
        ptrs = x.ptr | ws[0][2].ptr | ws[-1][2].ptr
        words = 0
        for qw, qz, _ in ws:
            words |= qw.ptr | qz.ptr
        aligned = not (ptrs & 7 or words & (4 * wpl - 1))
        sh = self.sh
        return Case(self.dtype, m, sh.K, sh.N, aligned=aligned, tc=self.tc, bs=sh.group_size)

    def compute(self, ctx, inputs):
        x, ws, bs, m = self.operands(inputs)
        sh = self.sh
        out = ctx.output(0, tuple(x.shape[:-1]) + (sh.N,))
        if m == 0:
            return
        ptrs = x.ptr | out
        words = scales = 0
        for b in bs:
            ptrs |= b.ptr if b is not None else 0
        for qw, qz, sc in ws:
            words |= qw.ptr | qz.ptr
            scales |= sc.ptr
        if ptrs & (1 if self.a16 else 3) or words & 3 or scales & 1:
            raise KernelError("inputs and the output must be aligned device buffers (X, biases, output to their "
                              "element, qweight and qzeros to 4 bytes, scales to 2)")
        kernel = route(self.ROUTES, self.case(m, x, ws, ctx.has_scratch)).kernel
        self.launch[kernel](kernel, ctx, m, x, ws, bs, out)

    def _gemv(self, kernel, ctx, m, x, ws, bs, out):
        sp = self.gemv[1 if kernel == "gemv1" else 8]
        m1.session_launch(sp, ctx, self.scratch, x, ws[0], ws[1] if self.NW == 2 else None, bs[0],
                          bs[1] if self.NW == 2 else None, out, self.sh.N, m)

    def _args(self, m, x, ws, bs, out):
        sh = self.sh
        args = [(x.ptr, (m * sh.K,))]
        for w in ws:
            args += [(t.ptr, (t.size,)) for t in w]
        args += [(b.ptr, (sh.N,)) if b is not None else (out, (sh.N,)) for b in bs]
        return args + [(out, (m * sh.N,))]

    def _decode(self, kernel, ctx, m, x, ws, bs, out):
        sh = self.sh
        grid, rows, splits = self.plans[m]
        part = self.scratch.partials(ctx, partial_floats(splits, self.NW, m, sh.N))
        self.decode[bucket(m, self.NW)].launch(grid, BLOCK, ctx.stream, *self._args(m, x, ws, bs, out), part,
                                               self.scratch.counters(ctx.stream), m, sh.K, sh.N, sh.group_size,
                                               rows, splits, *[int(b is not None) for b in bs])

    def _generic(self, kernel, ctx, m, x, ws, bs, out):
        sh = self.sh
        self.generic.launch(self.tiles * -(-m // WARPS), BLOCK, ctx.stream, *self._args(m, x, ws, bs, out), m, sh.K,
                            sh.N, sh.group_size, *[int(b is not None) for b in bs])
