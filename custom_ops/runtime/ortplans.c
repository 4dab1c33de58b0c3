/* onnx-lowbit's onnxruntime bridge, part two: scratch memory and native plans (keys, checks, replay of CUDA launches,
 * cuBLAS calls and CPU entry points). Not compiled on its own: ortshim.c includes it, so that the shim stays one
 * translation unit (its statics private, one compiler call; build.py hashes both files). */
/* Scratch: `bytes` from onnxruntime's allocator of the kernel's device, ordered on this call's compute stream
 * (KernelContext_GetScratchBuffer: what onnxruntime's own CUDA kernels use), and given back to the same allocator
 * (KernelContext_GetAllocator looks it up exactly as GetScratchBuffer does) once the call's work is issued: the
 * stream-aware arena hands the block to later work on the same stream only (other streams wait for this one). */
static OrtStatus* scratch_get(const LbKernel* k, void* ctx, int64_t bytes, void** out) {
  char err[320];
  *out = NULL;
  if (bytes <= 0) return NULL;
  if (!k->mem_info) {
    snprintf(err, sizeof err, "onnx_lowbit %s: %s", k->op->name, k->no_scratch);
    return fail(err);
  }
  OrtStatus* st = API(I_KernelContext_GetScratchBuffer, f_CtxGetScratch)(ctx, k->mem_info, (size_t)bytes, out);
  if (st) return st;
  if (!*out) {
    snprintf(err, sizeof err, "onnx_lowbit %s: onnxruntime's allocator gave no %lld bytes of scratch", k->op->name,
             (long long)bytes);
    return fail(err);
  }
  __atomic_add_fetch(&g_scratch_counts[0], 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&g_scratch_counts[2], bytes, __ATOMIC_RELAXED);
  return NULL;
}

static OrtStatus* scratch_put(const LbKernel* k, void* ctx, void* p) {
  if (!p) return NULL;
  void* a = NULL;
  OrtStatus* st = API(I_KernelContext_GetAllocator, f_CtxGetAllocator)(ctx, k->mem_info, &a);
  if (st) return st;
  ((LbAllocator*)a)->Free((LbAllocator*)a, p);
  API(I_ReleaseAllocator, f_ReleaseAllocator)(a);
  __atomic_add_fetch(&g_scratch_counts[1], 1, __ATOMIC_RELAXED);
  return NULL;
}

/* Plan key: per input its element type, rank, dims and pointer alignment (CUDA kernels may pick a code path by
 * alignment; CPU entry points take any address: 0 for CPU ops), then the stream (cuBLAS handles are bound to one). */
static int make_key(int64_t* key, const LbTensor* ins, size_t n_in, void* stream, int is_cuda) {
  int n = 0;
  key[n++] = (int64_t)n_in;
  for (size_t i = 0; i < n_in; ++i) {
    const LbTensor* t = &ins[i];
    key[n++] = t->elem_type;
    key[n++] = t->elem_type ? t->ndim : -1;
    key[n++] = t->elem_type && is_cuda ? (int64_t)((uintptr_t)t->data & 255) : 0;
    for (int d = 0; t->elem_type && d < t->ndim; ++d) key[n++] = t->dims[d];
  }
  key[n++] = (int64_t)(uintptr_t)stream;
  return n;
}

static int plan_ok(const LbPlan* plan, int is_cuda) {
  if (plan->n_steps < 0 || plan->n_steps > LB_MAX_STEPS || plan->n_out < 0 || plan->n_out > LB_MAX_IO ||
      plan->scratch < 0) return 0;
  for (int s = 0; s < plan->n_steps; ++s) {
    const LbStep* st = &plan->steps[s];
    if (st->n_params < 0 || st->n_params > LB_MAX_PARAMS || st->n_patch < 0 || st->n_patch > LB_MAX_PATCH) return 0;
    if (!is_cuda) {
      if (st->kind != LB_STEP_CPU || !st->func || st->grid < 0 || st->block < 0) return 0;
    } else if (st->kind != LB_STEP_LAUNCH && !(st->kind == LB_STEP_GEMM && st->n_params == LB_GEMM_ARGS) &&
               !(st->kind == LB_STEP_COOP && g_launch_coop) && !(st->kind == LB_STEP_PDL && g_launch_ex)) return 0;
    for (int i = 0; i < st->n_patch; ++i) {
      int64_t kind = st->patch_kind[i];
      if (st->patch_slot[i] < 0 || st->patch_slot[i] >= st->n_params || st->patch_index[i] < 0 ||
          st->patch_index[i] >= LB_MAX_IO || kind < LB_PATCH_INPUT || kind > LB_PATCH_SCRATCH) return 0;
      if (kind == LB_PATCH_SCRATCH && (st->patch_index[i] != 0 || st->patch_off[i] < 0 ||
                                       st->patch_off[i] >= plan->scratch)) return 0;
    }
  }
  return 1;
}

static int add_plan(LbKernel* k, LbPlan* plan) {
  if (!plan_ok(plan, k->op->is_cuda) || (!k->op->is_cuda && plan->n_steps == 0)) return 0;
  int added = 0;
  pthread_mutex_lock(&k->mu);
  int n = k->n_plans;
  int dup = 0;
  for (int i = 0; i < n; ++i)
    if (k->plans[i]->key_len == plan->key_len &&
        memcmp(k->plans[i]->key, plan->key, (size_t)plan->key_len * sizeof(int64_t)) == 0) dup = 1;
  if (!dup && n < LB_MAX_PLANS) {
    k->plans[n] = plan;
    __atomic_store_n(&k->n_plans, n + 1, __ATOMIC_RELEASE);
    added = 1;
  }
  pthread_mutex_unlock(&k->mu);
  return added;
}

/* A CPU step: `items` work items in tasks of at least `grain` items (at most LB_MAX_TASKS tasks), run through
 * onnxruntime's intra-op thread pool (KernelContext_ParallelFor: the caller's thread takes part; with one intra-op
 * thread the tasks run one after another on it) when there is more than one task and a kernel context, else as one
 * call on this thread. Returns 0, or the nonzero status an entry returned. */
typedef int32_t (*f_cpu_entry)(const uint64_t* params, int64_t begin, int64_t end);
typedef struct {
  f_cpu_entry fn;
  const uint64_t* params;
  int64_t items, tasks;
  int32_t rc;
} LbTasks;

static void run_task(void* user, size_t i) {
  LbTasks* t = (LbTasks*)user;
  int64_t begin = t->items * (int64_t)i / t->tasks, end = t->items * ((int64_t)i + 1) / t->tasks;
  int32_t rc = t->fn(t->params, begin, end);
  if (rc) __atomic_store_n(&t->rc, rc, __ATOMIC_RELAXED);
}

static int run_cpu(void* ctx, uint64_t func, int64_t items, int64_t grain, const uint64_t* params) {
  f_cpu_entry fn = (f_cpu_entry)(uintptr_t)func;
  int64_t tasks = grain > 0 ? items / grain : 1;
  if (tasks > LB_MAX_TASKS) tasks = LB_MAX_TASKS;
  if (tasks <= 1 || !ctx || !g_cpu_pool || g_api_version < 18) return fn(params, 0, items);
  LbTasks t = {fn, params, items, tasks, 0};
  OrtStatus* st = API(I_KernelContext_ParallelFor, f_CtxParallelFor)(ctx, run_task, (size_t)tasks, 0, &t);
  if (st) { /* no pool: the whole range here */
    API(I_ReleaseStatus, f_ReleaseStatus)(st);
    return fn(params, 0, items);
  }
  return __atomic_load_n(&t.rc, __ATOMIC_RELAXED);
}

/* One recorded step with this call's pointers patched in; returns the CUDA / cuBLAS status or a CPU entry's
 * (0 = success). ctx: the call's kernel context (CPU steps' thread pool; NULL: none). */
static int run_step(const LbStep* sp, const LbTensor* ins, void* const* outs, void* scratch, void* stream, void* ctx) {
  uint64_t pv[LB_MAX_PARAMS];
  memcpy(pv, sp->params, (size_t)sp->n_params * sizeof(uint64_t));
  for (int i = 0; i < sp->n_patch; ++i) {
    int64_t kind = sp->patch_kind[i];
    const char* base = kind == LB_PATCH_INPUT ? (const char*)ins[sp->patch_index[i]].data
                       : kind == LB_PATCH_OUTPUT ? (const char*)outs[sp->patch_index[i]] : (const char*)scratch;
    pv[sp->patch_slot[i]] = (uint64_t)(uintptr_t)(base + sp->patch_off[i]);
  }
  if (sp->kind == LB_STEP_CPU) return run_cpu(ctx, sp->func, sp->grid, sp->block, pv);
  if (sp->kind == LB_STEP_GEMM) { /* the handle is bound to this plan's stream (part of the key) */
#define P(i) ((void*)(uintptr_t)pv[i])
#define I(i) ((int)(int64_t)pv[i])
    return ((f_cublasGemmEx)(uintptr_t)sp->func)(P(0), I(1), I(2), I(3), I(4), I(5), &pv[6], P(7), I(8), I(9), P(10),
                                                  I(11), I(12), &pv[13], P(14), I(15), I(16), I(17), I(18));
#undef P
#undef I
  }
  void* pp[LB_MAX_PARAMS];
  for (int i = 0; i < sp->n_params; ++i) pp[i] = &pv[i];
  if (sp->kind == LB_STEP_COOP) /* 1 = CUDA_ERROR_INVALID_VALUE when no cooperative launch is installed */
    return g_launch_coop ? g_launch_coop((void*)(uintptr_t)sp->func, (unsigned)sp->grid, 1, 1, (unsigned)sp->block, 1,
                                         1, (unsigned)sp->shmem, stream, pp)
                         : 1;
  if (sp->kind == LB_STEP_PDL) { /* programmatic dependent launch (device/pdl.py) */
    LbLaunchAttr attr;
    memset(&attr, 0, sizeof attr);
    attr.id = LB_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.i = 1;
    LbLaunchConfig cfg = {(unsigned)sp->grid, 1, 1, (unsigned)sp->block, 1, 1, (unsigned)sp->shmem, stream, &attr, 1};
    return g_launch_ex ? g_launch_ex(&cfg, (void*)(uintptr_t)sp->func, pp, NULL) : 1;
  }
  return g_launch((void*)(uintptr_t)sp->func, (unsigned)sp->grid, 1, 1, (unsigned)sp->block, 1, 1, (unsigned)sp->shmem,
                  stream, pp, NULL);
}

/* Issues a plan's steps with this call's input/output/scratch pointers patched in; returns 0, or the failing
 * step's CUDA / cuBLAS status and its index in *failed. Exported so that tests can run it on the CPU with
 * stand-in functions. */
static int replay(const LbPlan* p, const LbTensor* ins, void* const* outs, void* scratch, void* stream, void* ctx,
                  int* failed) {
  int rc = 0, s = 0;
  for (; s < p->n_steps && rc == 0; ++s) rc = run_step(&p->steps[s], ins, outs, scratch, stream, ctx);
  if (rc && failed) *failed = s - 1;
  return rc;
}

int lb_replay(const LbPlan* p, const LbTensor* ins, void* const* outs, void* scratch, void* stream, int* failed) {
  return replay(p, ins, outs, scratch, stream, NULL, failed);
}

/* Replays a plan: allocates the outputs with the recorded shapes, takes the scratch buffer, issues the recorded
 * steps with this call's pointers patched in and gives the scratch back. No Python, no GIL. A CPU entry that
 * declines the call's values sets *declined (the caller then serves the call through Python). */
static OrtStatus* run_plan(const LbKernel* k, const LbPlan* p, void* ctx, const LbTensor* ins, void* stream,
                           int* declined) {
  char err[256];
  void* outs[LB_MAX_IO] = {0};
  OrtStatus* st;
  for (int o = 0; o < p->n_out; ++o) {
    if (p->out_ndim[o] < 0) continue;
    void* value = NULL;
    if ((st = API(I_KernelContext_GetOutput, f_CtxGetOutput)(ctx, (size_t)o, p->out_dims[o], (size_t)p->out_ndim[o],
                                                               &value))) return st;
    if ((st = API(I_GetTensorMutableData, f_GetTensorMutableData)(value, &outs[o]))) return st;
  }
  void* scratch = NULL;
  if ((st = scratch_get(k, ctx, p->scratch, &scratch))) return st;
  int failed = 0;
  int rc = replay(p, ins, outs, scratch, stream, ctx, &failed);
  st = scratch_put(k, ctx, scratch);
  if (rc && !k->op->is_cuda) {
    *declined = 1;
    return st;
  }
  if (rc) {
    if (st) API(I_ReleaseStatus, f_ReleaseStatus)(st);
    int gemm = p->steps[failed].kind == LB_STEP_GEMM, coop = p->steps[failed].kind == LB_STEP_COOP,
        pdl = p->steps[failed].kind == LB_STEP_PDL;
    snprintf(err, sizeof err, "onnx_lowbit %s: %s failed: %s status %d", k->op->name,
             gemm ? "cublasGemmEx" : coop ? "cuLaunchCooperativeKernel" : pdl ? "cuLaunchKernelEx" : "cuLaunchKernel",
             gemm ? "cuBLAS" : "CUDA", rc);
    return fail(err);
  }
  return st;
}
