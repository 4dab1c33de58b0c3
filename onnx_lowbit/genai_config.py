"""onnxruntime-genai model folders (genai_config.json + model.onnx + tokenizer files, as genai's model builder
writes them): rewrite the model with our passes and keep the folder a genai model that loads our ops.

    rewrite_folder(src, dst)    copies the folder, rewrites its decoder model (default passes: matmulnbits, ffn: the
                                SwiGLU blocks become FusedFFN (float models) or, int4 models, every symmetric
                                MatMulNBits becomes MatMulNF4 int4 (lossless) and the SwiGLU pairs FusedFFNNF4;
                                ``matmulnbits_to="awq"``: only the pairs, FusedFFNAWQ), puts our shim
                                library into dst and names it in genai_config.json
                                (model.decoder.session_options.custom_ops_library); returns the Report
    set_provider(dst, "cpu")    the decoder's execution provider in genai_config.json ("cpu", "cuda"; CUDA graphs)
    prepare(folder)             before og.Model(folder): makes this process's Python side of our kernels the very
                                shim file genai will dlopen (see below); returns its path
    model(folder)               prepare + onnxruntime_genai.Model(folder)

How genai loads our ops: genai (0.18) dlopens ``custom_ops_library`` into the onnxruntime it loaded itself (the
``onnxruntime`` Python package's capi/libonnxruntime.so, a second onnxruntime in the process next to the
pybind module's own copy) and calls our shim's RegisterCustomOps. The library must lie in the model folder (or the
working directory, or an EP library's folder): genai refuses other paths (and symlinks out of the folder, since it
resolves them). Our kernels' Python side is reached through callbacks the bridge sets in the shim it loaded with
ctypes; the dynamic loader gives genai that same loaded object only for the same file (same inode), so the bridge
must load the folder's copy (``prepare`` does that, or hard-links the folder's copy to the one already loaded).
Import order: ``prepare`` before ``og.Model``. The shim keeps one OrtApi table, the one of the onnxruntime that
registered it last: in one process, run our ops in genai models or in onnxruntime Python sessions, not both.
"""
from __future__ import annotations

import json
import os
import shutil

from .errors import LowbitError

CONFIG = "genai_config.json"
SHIM_NAME = "onnx_lowbit_ortshim.so"   # the shim's name in the model folder
DEFAULT_PASSES = ("matmulnbits", "ffn")
# The default where the decoder runs on CUDA (``default_passes``): also GroupQueryAttention -> CacheAttention where
# its tensor-core prompt kernel takes the heads (option cacheattention_tc_only). H200, genai's loop, 2026-11-30
# (BENCHMARKS.md, "CacheAttention in genai's loop"): decode 1.33-1.37x genai int4 against 1.20-1.21x without it,
# prompts level at 1024 tokens and faster at 128; SmolLM2-135M's real weights: 1.25-1.30x against 1.19-1.20x.
# And genai's SkipSimplifiedLayerNormalization / SimplifiedLayerNormalization -> RMSNorm (ortnorm, option
# ortnorm_vector_only: fp16 rows its CUDA vector kernel takes), a programmatic dependent launch the next product
# overlaps: H200, 2026-12-01, d = 2048 int4 config decode 1.56x / 1.54x genai int4 against 1.47x without it in the
# same run (BENCHMARKS.md, "onnxruntime-genai's loop today").
CUDA_PASSES = ("matmulnbits", "ffn", "cacheattention", "ortnorm")
# The option each default pass runs with when `onnx-lowbit genai` picks the passes (a user's --passes runs them
# unrestricted): only the heads / rows whose CUDA kernels the figures above were measured on.
DEFAULT_OPTIONS = {"cacheattention": "cacheattention_tc_only", "ortnorm": "ortnorm_vector_only"}
# The default where the decoder runs on the CPU: genai's int4 products only (MatMulNBits -> MatMulNF4 int4, lossless,
# our level-4 kernels). SmolLM2-135M's int4 CPU build, genai's loop, 2026-11-30 (BENCHMARKS.md, "onnxruntime-genai's
# int4 model on the CPU"): prefill 2.1x faster than genai's with the products alone against 1.7x with the SwiGLU pairs
# fused too (FusedFFNNF4), decode level with both (0.94-1.03x / 0.90-1.00x); on the fp32 build the float FusedFFN
# left decode level and made prefill 1.10-1.22x slower. So no FFN fusion by default on the CPU (--passes names it).
CPU_PASSES = ("matmulnbits",)


def default_passes(provider: str | None, folder=None, to: str | None = None) -> tuple:
    """The passes ``onnx-lowbit genai`` runs when none are named: CUDA_PASSES where the decoder runs on CUDA
    (``provider``, else the folder's genai_config.json), CPU_PASSES where it runs on the CPU; DEFAULT_PASSES when
    neither is known. ``to="awq"`` (the matmulnbits pass converts only the SwiGLU pairs, for the fused FFN op):
    always with ffn."""
    if provider is None and folder is not None:
        provider = "cuda" if on_cuda(folder) else "cpu"
    if provider is None:
        passes = DEFAULT_PASSES
    else:
        passes = CUDA_PASSES if provider == "cuda" else CPU_PASSES
    if to == "awq" and "ffn" not in passes:
        passes += ("ffn",)
    return passes


def on_cuda(folder) -> bool:
    """Whether the folder's decoder names the cuda provider in genai_config.json."""
    sess = decoder(read_config(folder)).get("session_options", {})
    return any("cuda" in p for p in sess.get("provider_options") or [])


def read_config(folder) -> dict:
    path = os.path.join(os.fspath(folder), CONFIG)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise LowbitError(f"{folder}: no {CONFIG} (not an onnxruntime-genai model folder)") from None


def write_config(folder, config: dict) -> None:
    path = os.path.join(os.fspath(folder), CONFIG)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=4)
        f.write("\n")
    os.replace(tmp, path)


def decoder(config: dict) -> dict:
    try:
        return config["model"]["decoder"]
    except KeyError:
        raise LowbitError(f"{CONFIG} has no model.decoder section") from None


def _data_files(model_path: str) -> set:
    """The external data files a model refers to (relative names)."""
    import onnx  # noqa: PLC0415
    m = onnx.load(model_path, load_external_data=False)
    names = set()
    for t in list(m.graph.initializer):
        for e in t.external_data:
            if e.key == "location":
                names.add(e.value)
    return names


DEFAULT_TO = "int4"     # the matmulnbits pass's target here (docs/genai.md: faster than "awq" on the CPU and the GPU)


def rewrite_folder(src, dst, passes=DEFAULT_PASSES, filename: str | None = None, library: bool = True, **options):
    """Rewrites the genai folder ``src`` into the new folder ``dst`` (see the module doc); ``filename`` the
    rewritten model's name (default: the source's); ``library``: copy the shim into dst and name it in the
    config (False: a model without our ops, e.g. --target ort passes); ``matmulnbits_to`` (default DEFAULT_TO):
    "int4" (every symmetric MatMulNBits -> MatMulNF4 int4) or "awq" (the SwiGLU pairs -> MatMulAWQ). Returns the
    Report."""
    from . import api  # noqa: PLC0415
    src, dst = os.fspath(src), os.fspath(dst)
    config = read_config(src)
    options.setdefault("matmulnbits_to", DEFAULT_TO)
    options.setdefault("cacheattention_share_buffer",
                       bool(config.get("search", {}).get("past_present_share_buffer", False)))
    dec = decoder(config)
    name = dec.get("filename", "model.onnx")
    model_src = os.path.join(src, name)
    if os.path.exists(dst) and os.listdir(dst):
        raise LowbitError(f"{dst} exists and is not empty")
    os.makedirs(dst, exist_ok=True)
    skip = {name, CONFIG} | _data_files(model_src)
    for entry in os.listdir(src):
        if entry not in skip and os.path.isfile(os.path.join(src, entry)):
            shutil.copy2(os.path.join(src, entry), os.path.join(dst, entry))
    out_name = filename or name
    report = api.rewrite_file(model_src, os.path.join(dst, out_name), passes=list(passes), **options)
    dec["filename"] = out_name
    sess = dec.setdefault("session_options", {})
    if library and _uses_our_ops(os.path.join(dst, out_name)):
        from onnx_lowbit.custom_ops.runtime import build  # noqa: PLC0415
        shutil.copy2(build.shim_path(), os.path.join(dst, SHIM_NAME))
        sess["custom_ops_library"] = SHIM_NAME
    else:
        sess.pop("custom_ops_library", None)
    write_config(dst, config)
    return report


def _uses_our_ops(model_path: str) -> bool:
    import onnx  # noqa: PLC0415

    from . import domain  # noqa: PLC0415
    m = onnx.load(model_path, load_external_data=False)
    return any(o.domain == domain.DOMAIN for o in m.opset_import)


def set_provider(folder, provider: str, cuda_graph: bool = False) -> None:
    """Sets the decoder's execution provider in the folder's genai_config.json: "cpu" (no provider options) or
    "cuda" (``enable_cuda_graph`` as given)."""
    config = read_config(folder)
    sess = decoder(config).setdefault("session_options", {})
    if provider == "cpu":
        sess["provider_options"] = []
    elif provider == "cuda":
        sess["provider_options"] = [{"cuda": {"enable_cuda_graph": "1" if cuda_graph else "0"}}]
    else:
        raise ValueError(f"provider must be 'cpu' or 'cuda', got {provider!r}")
    write_config(folder, config)


def library_file(folder) -> str | None:
    """The absolute path of the custom-op library the folder's config names, or None."""
    lib = decoder(read_config(folder)).get("session_options", {}).get("custom_ops_library")
    return None if not lib else os.path.abspath(os.path.join(os.fspath(folder), lib))


def prepare(folder) -> str | None:
    """Makes the shim genai will dlopen for ``folder`` the one this process's bridge uses (call it before
    og.Model): loads the folder's copy when no shim is loaded yet; when another file is, replaces the folder's copy
    by a hard link to it (same inode: the loader hands genai the loaded object). Returns the library path (None
    when the folder's model needs no library). Raises LowbitError when neither works."""
    lib = library_file(folder)
    if lib is None:
        return None
    if not os.path.exists(lib):
        raise LowbitError(f"{lib} (named by {CONFIG}) does not exist")
    from onnx_lowbit import domain  # noqa: PLC0415
    from onnx_lowbit.custom_ops.runtime import bridge  # noqa: PLC0415
    domain.register_schemas()
    loaded = bridge.library_path(lib)
    if os.path.samefile(loaded, lib):
        return lib
    tmp = lib + ".link"
    try:
        if os.path.exists(tmp):
            os.unlink(tmp)
        os.link(loaded, tmp)
        os.replace(tmp, lib)
    except OSError as e:
        raise LowbitError(f"this process already loaded our shim from {loaded}, and {lib} cannot be made the same "
                          f"file ({e}); call onnx_lowbit.genai_config.prepare(folder) before any other use of "
                          "onnx_lowbit's ops in the process") from None
    return lib


def model(folder):
    """prepare(folder), then onnxruntime_genai.Model(folder)."""
    prepare(folder)
    import onnxruntime_genai as og  # noqa: PLC0415
    return og.Model(os.fspath(folder))
