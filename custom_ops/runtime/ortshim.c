/* onnx-lowbit's onnxruntime bridge: a header-free C shim.
 *
 * onnxruntime loads this library through SessionOptions.register_custom_ops_library(path) and calls
 * RegisterCustomOps. The shim registers one OrtCustomOp per (op, type variant, execution provider) that Python
 * declared with lb_add_op, and forwards kernel creation and compute to Python callbacks (set with
 * lb_set_callbacks before any session is created; Python loads this same file with ctypes first, and
 * onnxruntime's later dlopen of the same path returns the same instance).
 *
 * No onnxruntime header is used: OrtApi functions are called by their slot index in the OrtApi function table
 * (the C API is append-only, so indices never move; we ask for API version 18, or 16 from onnxruntime 1.16 / 1.17,
 * which then lack scratch memory), and OrtCustomOp is laid out here by hand as its version-16 prefix, reserved at
 * the 1.23 size. Only libc is linked. Scratch memory and native plans live in ortplans.c, included below (one
 * translation unit).
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LB_API_VERSION 18     /* asked for first: scratch memory (KernelContext_GetScratchBuffer) */
#define LB_API_MIN 16         /* enough for everything else */
#define LB_OP_VERSION 16      /* OrtCustomOp's layout: its version-16 prefix */
#define LB_MAX_OPS 256
#define LB_MAX_IO 16
#define LB_MAX_DIMS 8
#define LB_ERRLEN 2048
#define LB_MAX_PLANS 32     /* launch plans per kernel (distinct input shapes / streams) */
#define LB_MAX_STEPS 16     /* steps (kernel launches, cuBLAS calls) per plan */
#define LB_MAX_PARAMS 192   /* flattened kernel parameters per launch, 8 bytes each */
#define LB_MAX_PATCH 16     /* parameters per launch that take an input/output/scratch pointer */
#define LB_KEY_MAX (2 + LB_MAX_IO * (3 + LB_MAX_DIMS))

/* OrtApi slot indices (zero-based position in struct OrtApi). */
enum {
  I_CreateStatus = 0,
  I_GetErrorMessage = 2,
  I_CreateCustomOpDomain = 26,
  I_CustomOpDomain_Add = 27,
  I_AddCustomOpDomain = 28,
  I_GetTensorMutableData = 51,
  I_GetTensorElementType = 60,
  I_GetDimensionsCount = 61,
  I_GetDimensions = 62,
  I_GetTensorTypeAndShape = 65,
  I_KernelInfoGetAttribute_float = 85,
  I_KernelInfoGetAttribute_int64 = 86,
  I_KernelInfoGetAttribute_string = 87,
  I_KernelContext_GetInputCount = 88,
  I_KernelContext_GetOutputCount = 89,
  I_KernelContext_GetInput = 90,
  I_KernelContext_GetOutput = 91,
  I_ReleaseStatus = 93,
  I_ReleaseTensorTypeAndShapeInfo = 99,
  I_ReleaseAllocator = 132,
  I_KernelInfoGetAttributeArray_float = 162,
  I_KernelInfoGetAttributeArray_int64 = 163,
  I_KernelContext_GetGPUComputeStream = 193,
  I_KernelInfo_GetNodeName = 244,
  I_KernelInfoGetConstantInput_tensor = 249,   /* version 15 */
  I_KernelContext_GetAllocator = 253,          /* version 14 */
  I_KernelContext_ParallelFor = 274,           /* version 17: onnxruntime's intra-op thread pool */
  I_KernelContext_GetScratchBuffer = 277,      /* version 18 */
  I_KernelInfoGetAllocator = 278,              /* version 18 */
};

typedef void OrtStatus;
typedef struct { const void* const* (*GetApi)(uint32_t version); const char* (*GetVersionString)(void); } LbApiBase;

static const void* const* g_api = NULL;
static uint32_t g_api_version = 0;
static const char* g_ort_version = "";
#define API(idx, type) ((type)(g_api[idx]))

typedef OrtStatus* (*f_CreateStatus)(int code, const char* msg);
typedef const char* (*f_GetErrorMessage)(const OrtStatus*);
typedef void (*f_ReleaseStatus)(OrtStatus*);
typedef OrtStatus* (*f_CreateCustomOpDomain)(const char*, void**);
typedef OrtStatus* (*f_CustomOpDomain_Add)(void*, const void*);
typedef OrtStatus* (*f_AddCustomOpDomain)(void*, void*);
typedef OrtStatus* (*f_GetTensorMutableData)(void*, void**);
typedef OrtStatus* (*f_GetTensorElementType)(const void*, int*);
typedef OrtStatus* (*f_GetDimensionsCount)(const void*, size_t*);
typedef OrtStatus* (*f_GetDimensions)(const void*, int64_t*, size_t);
typedef OrtStatus* (*f_GetTensorTypeAndShape)(const void*, void**);
typedef void (*f_ReleaseTensorTypeAndShapeInfo)(void*);
typedef OrtStatus* (*f_AttrFloat)(const void*, const char*, float*);
typedef OrtStatus* (*f_AttrInt)(const void*, const char*, int64_t*);
typedef OrtStatus* (*f_AttrString)(const void*, const char*, char*, size_t*);
typedef OrtStatus* (*f_AttrArrayFloat)(const void*, const char*, float*, size_t*);
typedef OrtStatus* (*f_AttrArrayInt)(const void*, const char*, int64_t*, size_t*);
typedef OrtStatus* (*f_NodeName)(const void*, char*, size_t*);
typedef OrtStatus* (*f_InfoConstInput)(const void*, size_t, int*, const void**);
typedef OrtStatus* (*f_CtxCount)(const void*, size_t*);
typedef OrtStatus* (*f_CtxGetInput)(const void*, size_t, const void**);
typedef OrtStatus* (*f_CtxGetOutput)(void*, size_t, const int64_t*, size_t, void**);
typedef OrtStatus* (*f_CtxGetStream)(const void*, void**);
typedef OrtStatus* (*f_InfoGetAllocator)(const void* info, int mem_type, void** out);
typedef OrtStatus* (*f_CtxGetAllocator)(const void* ctx, const void* mem_info, void** out);
typedef OrtStatus* (*f_CtxGetScratch)(const void* ctx, const void* mem_info, size_t bytes, void** out);
typedef void (*f_ReleaseAllocator)(void*);
typedef OrtStatus* (*f_CtxParallelFor)(const void* ctx, void (*fn)(void*, size_t), size_t total, size_t num_batch,
                                       void* usr_data);

/* OrtAllocator: its first members (later versions append). */
typedef struct LbAllocator {
  uint32_t version;
  void* (*Alloc)(struct LbAllocator*, size_t);
  void (*Free)(struct LbAllocator*, void*);
  const void* (*Info)(const struct LbAllocator*);
} LbAllocator;

/* OrtCustomOp, version-16 prefix; byte offsets on LP64 in comments. */
typedef struct LbOp {
  uint32_t version;                                                              /*   0 */
  void* (*CreateKernel)(const struct LbOp*, const void*, const void*);           /*   8 */
  const char* (*GetName)(const struct LbOp*);                                    /*  16 */
  const char* (*GetExecutionProviderType)(const struct LbOp*);                   /*  24 */
  int (*GetInputType)(const struct LbOp*, size_t);                               /*  32 */
  size_t (*GetInputTypeCount)(const struct LbOp*);                               /*  40 */
  int (*GetOutputType)(const struct LbOp*, size_t);                              /*  48 */
  size_t (*GetOutputTypeCount)(const struct LbOp*);                              /*  56 */
  void (*KernelCompute)(void*, void*);                                           /*  64 */
  void (*KernelDestroy)(void*);                                                  /*  72 */
  int (*GetInputCharacteristic)(const struct LbOp*, size_t);                     /*  80 */
  int (*GetOutputCharacteristic)(const struct LbOp*, size_t);                    /*  88 */
  int (*GetInputMemoryType)(const struct LbOp*, size_t);                         /*  96 */
  int (*GetVariadicInputMinArity)(const struct LbOp*);                           /* 104 */
  int (*GetVariadicInputHomogeneity)(const struct LbOp*);                        /* 112 */
  int (*GetVariadicOutputMinArity)(const struct LbOp*);                          /* 120 */
  int (*GetVariadicOutputHomogeneity)(const struct LbOp*);                       /* 128 */
  OrtStatus* (*CreateKernelV2)(const struct LbOp*, const void*, const void*, void**); /* 136 */
  OrtStatus* (*KernelComputeV2)(void*, void*);                                   /* 144 */
  unsigned char reserved[208 - 152]; /* later members (shape inference, versions, aliasing): left zero */
  /* ---- ours, after what onnxruntime reads ---- */
  int index;
  int is_cuda;
  int n_in, n_out;
  int in_types[LB_MAX_IO], in_optional[LB_MAX_IO];
  int out_types[LB_MAX_IO], out_optional[LB_MAX_IO];
  char name[64];
} LbOp;

/* What Python receives per input. */
typedef struct {
  void* data;
  int64_t dims[LB_MAX_DIMS];
  int32_t elem_type; /* 0 = input absent */
  int32_t ndim;
} LbTensor;

/* A launch plan: what one compute call did, replayable without Python for the same key (input shapes, input
 * pointer alignment, stream). Filled by Python on a miss; layout mirrored in bridge.py (all 8-byte fields).
 * A step is a kernel launch (LB_STEP_LAUNCH: func is the CUfunction, params its flattened parameters; LB_STEP_COOP:
 * the same through cuLaunchCooperativeKernel, for kernels whose blocks must all be resident at once; LB_STEP_PDL:
 * through cuLaunchKernelEx with programmatic stream serialization, device/pdl.py's kernels) or a cuBLAS
 * GEMM (LB_STEP_GEMM: func is cublasGemmEx's address, params its 19 arguments in order, each in an 8-byte slot;
 * the two host scalars alpha (6) and beta (13) are passed by pointer to their slots, so their bytes lie in the
 * slot as in memory). Pointer parameters into this call's inputs, outputs or scratch buffer are patched in either
 * kind. The scratch buffer (`scratch` bytes, none when 0) is taken from onnxruntime's allocator for every call and
 * given back right after the steps are issued.
 * CPU ops' plans hold LB_STEP_CPU steps only: func is a compiled entry point with the C signature
 * int32_t entry(const uint64_t* params, int64_t begin, int64_t end) (Numba @cfunc), params its arguments (pointers
 * patched as above, integers), grid the number of work items and block the fewest items per task: the items are
 * split into tasks run on onnxruntime's intra-op thread pool (KernelContext_ParallelFor), each task calling the
 * entry on its range [begin, end). An entry returns 0, or nonzero when it declines the call's input values (then
 * the call is served by Python, which reports the problem). */
enum { LB_STEP_LAUNCH = 0, LB_STEP_GEMM = 1, LB_STEP_COOP = 2, LB_STEP_CPU = 3, LB_STEP_PDL = 4, LB_GEMM_ARGS = 19 };
#define LB_MAX_TASKS 256   /* tasks per CPU step */
enum { LB_PATCH_INPUT = 0, LB_PATCH_OUTPUT = 1, LB_PATCH_SCRATCH = 2 };

typedef struct {
  int64_t kind;                  /* LB_STEP_LAUNCH, LB_STEP_GEMM, LB_STEP_COOP, LB_STEP_CPU or LB_STEP_PDL */
  uint64_t func;                 /* CUfunction, the address of cublasGemmEx or of a CPU entry point */
  int64_t grid, block, shmem, n_params, n_patch;
  uint64_t params[LB_MAX_PARAMS]; /* each parameter's value in the low bytes of its 8-byte slot */
  int64_t patch_slot[LB_MAX_PATCH], patch_kind[LB_MAX_PATCH] /* LB_PATCH_* */,
      patch_index[LB_MAX_PATCH], patch_off[LB_MAX_PATCH];
} LbStep;

typedef struct {
  int64_t valid;   /* set by Python: this call can be replayed from the plan */
  int64_t never;   /* set by Python: this kernel never gives plans (do not ask again) */
  int64_t scratch; /* set by Python: bytes of scratch the call takes (0: none) */
  int64_t n_out;
  int64_t out_ndim[LB_MAX_IO];
  int64_t out_dims[LB_MAX_IO][LB_MAX_DIMS];
  int64_t n_steps;
  LbStep steps[LB_MAX_STEPS];
  int64_t key_len; /* set by C */
  int64_t key[LB_KEY_MAX];
} LbPlan;

typedef int (*f_cuLaunchKernel)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                unsigned shmem, void* stream, void** params, void** extra);

typedef int (*f_cuLaunchCooperativeKernel)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                           unsigned bz, unsigned shmem, void* stream, void** params);

/* cuLaunchKernelEx's configuration (cuda.h's CUlaunchConfig / CUlaunchAttribute, declared here so that the shim
 * needs no CUDA headers): one attribute, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) = 1. */
typedef struct {
  int id;
  int pad;
  union { char raw[64]; int i; } value;
} LbLaunchAttr;
typedef struct {
  unsigned gx, gy, gz, bx, by, bz, shmem;
  void* stream;
  LbLaunchAttr* attrs;
  unsigned n_attrs;
} LbLaunchConfig;
typedef int (*f_cuLaunchKernelEx)(const LbLaunchConfig* config, void* f, void** params, void** extra);
enum { LB_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6 };

typedef int (*f_cublasGemmEx)(void* handle, int transa, int transb, int m, int n, int k, const void* alpha,
                              const void* a, int a_type, int lda, const void* b, int b_type, int ldb, const void* beta,
                              void* c, int c_type, int ldc, int compute_type, int algo);

typedef int64_t (*lb_create_cb)(int op_index, const void* info, char* err, int errlen);
typedef int (*lb_compute_cb)(int64_t kernel_id, void* call, int n_in, LbTensor* ins, void* stream, LbPlan* plan,
                             char* err, int errlen);
typedef void (*lb_destroy_cb)(int64_t kernel_id);

static lb_create_cb g_create = NULL;
static lb_compute_cb g_compute = NULL;
static lb_destroy_cb g_destroy = NULL;
static LbOp g_ops[LB_MAX_OPS];
static int g_n_ops = 0;
static const char* g_domain = "onnx_lowbit";

static f_cuLaunchKernel g_launch = NULL;
static f_cuLaunchCooperativeKernel g_launch_coop = NULL; /* NULL: plans with cooperative steps are not kept */
static f_cuLaunchKernelEx g_launch_ex = NULL;   /* NULL: plans with PDL steps are not kept */
static int g_plans_enabled = 1;
static int g_cpu_enabled = 1;  /* native replay of CPU ops' plans */
static int g_cpu_pool = 1;     /* CPU steps split over onnxruntime's thread pool (0: one task on the calling thread) */
static int64_t g_scratch_counts[3]; /* scratch buffers taken, given back, bytes taken (tests, diagnostics) */

typedef struct {
  const LbOp* op;
  int64_t id;
  int no_plans;                   /* the kernel said it never gives plans */
  int n_plans;                    /* published with release semantics; plans are never removed before destroy */
  LbPlan* plans[LB_MAX_PLANS];
  pthread_mutex_t mu;             /* serialises writers of plans */
  LbAllocator* alloc;             /* CUDA ops: onnxruntime's allocator of the kernel's device (KernelInfoGetAllocator) */
  const void* mem_info;           /* its OrtMemoryInfo: where scratch comes from; NULL: no scratch (onnxruntime < 1.18) */
  char no_scratch[160];           /* why mem_info is NULL */
} LbKernel;

/* One compute call as Python sees it (the `call` handle it passes back to lb_output / lb_scratch). */
typedef struct {
  void* ctx;                      /* OrtKernelContext */
  const LbKernel* k;
  void* scratch;                  /* this call's scratch buffer (NULL: none taken) */
  int64_t scratch_bytes;
  int scratch_taken;
} LbCall;

static OrtStatus* fail(const char* msg) { return API(I_CreateStatus, f_CreateStatus)(1 /* ORT_FAIL */, msg); }

/* Copies the status message into err and releases the status; returns 1 if there was an error. */
static int take_status(OrtStatus* st, char* err, int errlen) {
  if (!st) return 0;
  if (err && errlen > 0) {
    const char* m = API(I_GetErrorMessage, f_GetErrorMessage)(st);
    snprintf(err, (size_t)errlen, "%s", m ? m : "onnxruntime error");
  }
  API(I_ReleaseStatus, f_ReleaseStatus)(st);
  return 1;
}

static const char* op_name(const LbOp* op) { return op->name; }
static const char* op_ep(const LbOp* op) { return op->is_cuda ? "CUDAExecutionProvider" : "CPUExecutionProvider"; }
static int op_in_type(const LbOp* op, size_t i) { return i < (size_t)op->n_in ? op->in_types[i] : 0; }
static size_t op_in_count(const LbOp* op) { return (size_t)op->n_in; }
static int op_out_type(const LbOp* op, size_t i) { return i < (size_t)op->n_out ? op->out_types[i] : 0; }
static size_t op_out_count(const LbOp* op) { return (size_t)op->n_out; }
static int op_in_char(const LbOp* op, size_t i) { return i < (size_t)op->n_in && op->in_optional[i] ? 1 : 0; }
static int op_out_char(const LbOp* op, size_t i) { return i < (size_t)op->n_out && op->out_optional[i] ? 1 : 0; }
static int op_mem_type(const LbOp* op, size_t i) { (void)op; (void)i; return 0; /* OrtMemTypeDefault */ }
static int op_one(const LbOp* op) { (void)op; return 1; }
static int op_zero(const LbOp* op) { (void)op; return 0; }

/* The kernel's device allocator (CUDA ops): its OrtMemoryInfo names the device scratch comes from. */
static void find_allocator(LbKernel* k, const void* info) {
  if (g_api_version < 18) {
    snprintf(k->no_scratch, sizeof k->no_scratch, "scratch memory needs onnxruntime >= 1.18 (running %s)",
             g_ort_version);
    return;
  }
  void* a = NULL;
  char err[96] = "none";
  if (take_status(API(I_KernelInfoGetAllocator, f_InfoGetAllocator)(info, 0 /* OrtMemTypeDefault */, &a), err,
                  sizeof err) || !a) {
    snprintf(k->no_scratch, sizeof k->no_scratch, "no device allocator from onnxruntime: %s", err);
    return;
  }
  k->alloc = (LbAllocator*)a;
  k->mem_info = k->alloc->Info(k->alloc);
  if (!k->mem_info) snprintf(k->no_scratch, sizeof k->no_scratch, "the device allocator has no memory info");
}

static OrtStatus* op_create(const LbOp* op, const void* api, const void* info, void** kernel) {
  (void)api;
  char err[LB_ERRLEN];
  err[0] = 0;
  if (!g_create) return fail("onnx_lowbit: the Python side of the bridge is not loaded (import onnx_lowbit first)");
  int64_t id = g_create(op->index, info, err, LB_ERRLEN);
  if (id < 0) return fail(err[0] ? err : "onnx_lowbit: kernel creation failed");
  LbKernel* k = (LbKernel*)malloc(sizeof(LbKernel));
  if (!k) return fail("onnx_lowbit: out of memory");
  memset(k, 0, sizeof(*k));
  k->op = op;
  k->id = id;
  pthread_mutex_init(&k->mu, NULL);
  if (op->is_cuda) find_allocator(k, info);
  *kernel = k;
  return NULL;
}

#include "ortplans.c" /* scratch memory and native plans */

/* Fills t (data, element type, dims) from the tensor OrtValue v, and *rank; a rank over LB_MAX_DIMS leaves t
 * unset (the caller decides). */
static OrtStatus* read_tensor(const void* v, LbTensor* t, size_t* rank) {
  void* info = NULL;
  int et = 0;
  *rank = 0;
  OrtStatus* st = API(I_GetTensorTypeAndShape, f_GetTensorTypeAndShape)(v, &info);
  if (st) return st;
  st = API(I_GetTensorElementType, f_GetTensorElementType)(info, &et);
  if (!st) st = API(I_GetDimensionsCount, f_GetDimensionsCount)(info, rank);
  if (!st && *rank <= LB_MAX_DIMS) st = API(I_GetDimensions, f_GetDimensions)(info, t->dims, *rank);
  API(I_ReleaseTensorTypeAndShapeInfo, f_ReleaseTensorTypeAndShapeInfo)(info);
  if (st || *rank > LB_MAX_DIMS) return st;
  if ((st = API(I_GetTensorMutableData, f_GetTensorMutableData)((void*)v, &t->data))) return st;
  t->elem_type = et;
  t->ndim = (int32_t)*rank;
  return NULL;
}

static OrtStatus* op_compute(void* kernel, void* ctx) {
  LbKernel* k = (LbKernel*)kernel;
  char err[LB_ERRLEN];
  size_t n_in = 0;
  LbTensor ins[LB_MAX_IO];
  OrtStatus* st = API(I_KernelContext_GetInputCount, f_CtxCount)(ctx, &n_in);
  if (st) return st;
  if (n_in > LB_MAX_IO) return fail("onnx_lowbit: too many inputs");
  for (size_t i = 0; i < n_in; ++i) {
    const void* v = NULL;
    LbTensor* t = &ins[i];
    memset(t, 0, sizeof(*t));
    if ((st = API(I_KernelContext_GetInput, f_CtxGetInput)(ctx, i, &v))) return st;
    if (!v) continue; /* optional input left out */
    size_t nd = 0;
    if ((st = read_tensor(v, t, &nd))) return st;
    if (nd > LB_MAX_DIMS) {
      snprintf(err, sizeof err, "onnx_lowbit %s: input %zu has rank %zu, more than the supported %d",
               k->op->name, i, nd, LB_MAX_DIMS);
      return fail(err);
    }
  }
  void* stream = NULL;
  if (k->op->is_cuda) {
    if ((st = API(I_KernelContext_GetGPUComputeStream, f_CtxGetStream)(ctx, &stream))) return st;
  }
  LbPlan* plan = NULL;
  int64_t key[LB_KEY_MAX];
  int key_len = 0;
  int declined = 0;
  if ((k->op->is_cuda ? g_launch && g_plans_enabled : g_cpu_enabled) && !k->no_plans) {
    key_len = make_key(key, ins, n_in, stream, k->op->is_cuda);
    int n = __atomic_load_n(&k->n_plans, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; ++i) {
      const LbPlan* p = k->plans[i];
      if (p->key_len == key_len && memcmp(p->key, key, (size_t)key_len * sizeof(int64_t)) == 0) {
        st = run_plan(k, p, ctx, ins, stream, &declined);
        if (!declined) return st;
        if (st) API(I_ReleaseStatus, f_ReleaseStatus)(st);
        break;  /* the entry declined these values: Python serves the call (and names the problem) */
      }
    }
    if (n < LB_MAX_PLANS && !declined) {
      plan = (LbPlan*)calloc(1, sizeof(LbPlan));
      if (plan) {
        plan->key_len = key_len;
        memcpy(plan->key, key, (size_t)key_len * sizeof(int64_t));
      }
    }
  }
  err[0] = 0;
  if (!g_compute) { free(plan); return fail("onnx_lowbit: the Python side of the bridge is not loaded"); }
  LbCall call = {ctx, k, NULL, 0, 0};
  int bad = g_compute(k->id, &call, (int)n_in, ins, stream, plan, err, LB_ERRLEN);
  st = scratch_put(k, ctx, call.scratch); /* the call's work is issued (or it failed): give the scratch back */
  if (bad) {
    free(plan);
    if (st) API(I_ReleaseStatus, f_ReleaseStatus)(st);
    return fail(err[0] ? err : "onnx_lowbit: kernel failed");
  }
  if (plan) {
    if (plan->never) k->no_plans = 1;
    if (!plan->valid || plan->scratch != call.scratch_bytes || !add_plan(k, plan)) free(plan);
  }
  return st;
}

static void op_destroy(void* kernel) {
  LbKernel* k = (LbKernel*)kernel;
  if (!k) return;
  if (g_destroy) g_destroy(k->id);
  for (int i = 0; i < k->n_plans; ++i) free(k->plans[i]);
  if (k->alloc) API(I_ReleaseAllocator, f_ReleaseAllocator)(k->alloc);
  pthread_mutex_destroy(&k->mu);
  free(k);
}

/* ---------------- exported to Python ---------------- */

void lb_set_callbacks(lb_create_cb c, lb_compute_cb r, lb_destroy_cb d) { g_create = c; g_compute = r; g_destroy = d; }

/* The driver's cuLaunchKernel (Python passes its address, so the shim still links only libc) and the switch for
 * native plan replay (on by default; off: every call goes through Python, for comparisons). */
void* lb_set_launch(void* fn) {
  void* old = (void*)g_launch;
  g_launch = (f_cuLaunchKernel)fn;
  return old;
}
void* lb_set_launch_coop(void* fn) {
  void* old = (void*)g_launch_coop;
  g_launch_coop = (f_cuLaunchCooperativeKernel)fn;
  return old;
}
void* lb_set_launch_ex(void* fn) {
  void* old = (void*)g_launch_ex;
  g_launch_ex = (f_cuLaunchKernelEx)fn;
  return old;
}
void lb_set_plans(int enabled) { g_plans_enabled = enabled; }
/* Native replay of CPU ops (on by default; off: every CPU call through Python) and whether CPU steps use
 * onnxruntime's thread pool (on by default; off: one task on the calling thread). */
void lb_set_native_cpu(int enabled, int pool) { g_cpu_enabled = enabled; g_cpu_pool = pool; }

/* Runs a CPU step for Python (the call that records it): call may be NULL (no thread pool then). */
int lb_cpu_run(const LbCall* call, uint64_t func, int64_t items, int64_t grain, const uint64_t* params) {
  return run_cpu(call ? call->ctx : NULL, func, items, grain, params);
}
int lb_plan_size(void) { return (int)sizeof(LbPlan); }
void lb_scratch_counts(int64_t* out) {
  for (int i = 0; i < 3; ++i) out[i] = __atomic_load_n(&g_scratch_counts[i], __ATOMIC_RELAXED);
}
int lb_kernel_plans(void* kernel) { return kernel ? ((LbKernel*)kernel)->n_plans : 0; }

void lb_set_domain(const char* domain) {
  static char buf[128];
  snprintf(buf, sizeof buf, "%s", domain);
  g_domain = buf;
}

/* Declares one op variant; returns its index, or -1 when the table is full or the arguments are off. */
int lb_add_op(const char* name, int is_cuda, int n_in, const int* in_types, const int* in_optional, int n_out,
              const int* out_types, const int* out_optional) {
  if (g_n_ops >= LB_MAX_OPS || n_in > LB_MAX_IO || n_out > LB_MAX_IO || n_in < 0 || n_out < 1) return -1;
  LbOp* op = &g_ops[g_n_ops];
  memset(op, 0, sizeof(*op));
  op->version = LB_OP_VERSION;
  op->GetName = op_name;
  op->GetExecutionProviderType = op_ep;
  op->GetInputType = op_in_type;
  op->GetInputTypeCount = op_in_count;
  op->GetOutputType = op_out_type;
  op->GetOutputTypeCount = op_out_count;
  op->KernelDestroy = op_destroy;
  op->GetInputCharacteristic = op_in_char;
  op->GetOutputCharacteristic = op_out_char;
  op->GetInputMemoryType = op_mem_type;
  op->GetVariadicInputMinArity = op_one;
  op->GetVariadicInputHomogeneity = op_zero;
  op->GetVariadicOutputMinArity = op_one;
  op->GetVariadicOutputHomogeneity = op_zero;
  op->CreateKernelV2 = op_create;
  op->KernelComputeV2 = op_compute;
  op->index = g_n_ops;
  op->is_cuda = is_cuda;
  op->n_in = n_in;
  op->n_out = n_out;
  for (int i = 0; i < n_in; ++i) { op->in_types[i] = in_types[i]; op->in_optional[i] = in_optional[i]; }
  for (int i = 0; i < n_out; ++i) { op->out_types[i] = out_types[i]; op->out_optional[i] = out_optional[i]; }
  snprintf(op->name, sizeof op->name, "%s", name);
  return g_n_ops++;
}

int lb_op_struct_size(void) { return (int)offsetof(LbOp, index); }
/* The interface version Python checks (abi.SHIM_ABI): bumped when an exported function or a struct changes, so a
 * shim library built from an older source is never used with newer Python code. 2: native CPU steps; 3:
 * lb_const_input. */
int lb_abi(void) { return 4; }
const char* lb_ort_version(void) { return g_ort_version; }

/* Allocates output `index` of a compute call with the given shape; returns 0 and the data pointer. */
int lb_output(LbCall* call, int index, const int64_t* dims, int ndim, void** data, char* err, int errlen) {
  void* value = NULL;
  if (take_status(API(I_KernelContext_GetOutput, f_CtxGetOutput)(call->ctx, (size_t)index, dims, (size_t)ndim, &value),
                  err, errlen)) return 1;
  if (take_status(API(I_GetTensorMutableData, f_GetTensorMutableData)(value, data), err, errlen)) return 1;
  return 0;
}

/* How many outputs the node has (optional trailing outputs it leaves out are not counted). -1 on error. */
int64_t lb_output_count(LbCall* call) {
  size_t n = 0;
  OrtStatus* st = API(I_KernelContext_GetOutputCount, f_CtxCount)(call->ctx, &n);
  if (st) {
    API(I_ReleaseStatus, f_ReleaseStatus)(st);
    return -1;
  }
  return (int64_t)n;
}

/* Takes the compute call's scratch buffer (once per call; 0 bytes: none, *data NULL) from onnxruntime's allocator;
 * the shim gives it back when the call returns. Returns 0 and the pointer, or 1 with the reason in err. */
int lb_scratch(LbCall* call, int64_t bytes, void** data, char* err, int errlen) {
  *data = NULL;
  if (call->scratch_taken) {
    snprintf(err, (size_t)errlen, "scratch is taken once per compute call");
    return 1;
  }
  if (take_status(scratch_get(call->k, call->ctx, bytes, data), err, errlen)) return 1;
  call->scratch_taken = 1;
  call->scratch = *data;
  call->scratch_bytes = bytes > 0 ? bytes : 0;
  return 0;
}

/* Whether compute calls of this kernel can take scratch; if not, why (in err). */
int lb_scratch_ok(const LbCall* call, char* err, int errlen) {
  if (call->k->mem_info) return 1;
  snprintf(err, (size_t)errlen, "%s", call->k->no_scratch[0] ? call->k->no_scratch : "not a CUDA op");
  return 0;
}

/* Attribute readers: 0 = found, 1 = missing or wrong type (message in err). Arrays and strings follow
 * onnxruntime's two-call protocol: call with buf NULL to learn the size. */
int lb_attr_float(const void* info, const char* name, float* out, char* err, int errlen) {
  return take_status(API(I_KernelInfoGetAttribute_float, f_AttrFloat)(info, name, out), err, errlen);
}
int lb_attr_int(const void* info, const char* name, int64_t* out, char* err, int errlen) {
  return take_status(API(I_KernelInfoGetAttribute_int64, f_AttrInt)(info, name, out), err, errlen);
}
int lb_attr_string(const void* info, const char* name, char* buf, size_t* size, char* err, int errlen) {
  return take_status(API(I_KernelInfoGetAttribute_string, f_AttrString)(info, name, buf, size), err, errlen);
}
int lb_attr_floats(const void* info, const char* name, float* buf, size_t* size, char* err, int errlen) {
  return take_status(API(I_KernelInfoGetAttributeArray_float, f_AttrArrayFloat)(info, name, buf, size), err, errlen);
}
int lb_attr_ints(const void* info, const char* name, int64_t* buf, size_t* size, char* err, int errlen) {
  return take_status(API(I_KernelInfoGetAttributeArray_int64, f_AttrArrayInt)(info, name, buf, size), err, errlen);
}
int lb_node_name(const void* info, char* buf, size_t* size, char* err, int errlen) {
  return take_status(API(I_KernelInfo_GetNodeName, f_NodeName)(info, buf, size), err, errlen);
}
/* During kernel creation: the constant initializer feeding input `index` of the node
 * (KernelInfoGetConstantInput_tensor), into *t as compute calls see inputs; t->data stays NULL when the input is
 * none (a graph input, a computed value, an optional input left out). Its data lives as long as the session, and
 * compute calls get the same tensor. Returns 0, or 1 with a message in err. */
int lb_const_input(const void* info, int index, LbTensor* t, char* err, int errlen) {
  int is_const = 0;
  size_t rank = 0;
  const void* v = NULL;
  memset(t, 0, sizeof(*t));
  if (take_status(API(I_KernelInfoGetConstantInput_tensor, f_InfoConstInput)(info, (size_t)index, &is_const, &v), err,
                  errlen))
    return 1;
  if (!is_const || !v) return 0;
  if (take_status(read_tensor(v, t, &rank), err, errlen)) return 1;
  if (rank > LB_MAX_DIMS) memset(t, 0, sizeof(*t));   /* too deep to describe: treated as not constant */
  return 0;
}

/* The entry point onnxruntime calls from register_custom_ops_library. */
OrtStatus* RegisterCustomOps(void* options, const LbApiBase* api_base) {
  uint32_t version = LB_API_VERSION;
  const void* const* api = api_base->GetApi(version);
  if (!api) api = api_base->GetApi(version = LB_API_MIN); /* onnxruntime 1.16, 1.17: no scratch memory */
  if (!api) return NULL; /* cannot even build a status: onnxruntime older than 1.16 */
  g_api = api;
  g_api_version = version;
  if (api_base->GetVersionString) g_ort_version = api_base->GetVersionString();
  void* domain = NULL;
  OrtStatus* st = API(I_CreateCustomOpDomain, f_CreateCustomOpDomain)(g_domain, &domain);
  if (st) return st;
  for (int i = 0; i < g_n_ops; ++i) {
    if ((st = API(I_CustomOpDomain_Add, f_CustomOpDomain_Add)(domain, &g_ops[i]))) return st;
  }
  /* The domain must outlive every session that uses it: it is never released (one small object per call). */
  return API(I_AddCustomOpDomain, f_AddCustomOpDomain)(options, domain);
}
