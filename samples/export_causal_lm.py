"""Export a transformers causal LM to ONNX with the inputs and outputs optimum gives its "text-generation-with-past"
exports, so that ``onnx-lowbit rewrite --verify`` and ``onnx-lowbit eval-ppl`` can be tried on them without
optimum:

    inputs   input_ids [batch_size, sequence_length] int64, attention_mask [batch_size,
             past_sequence_length + sequence_length] int64, position_ids [batch_size, sequence_length] int64,
             past_key_values.<i>.key / .value [batch_size, kv_heads, past_sequence_length, head_dim]
    outputs  logits [batch_size, sequence_length, vocab], present.<i>.key / .value [batch_size, kv_heads,
             past_sequence_length + sequence_length, head_dim]

TorchScript exporter (``torch.onnx.export(..., dynamo=False)``), eager attention, dynamic axes named as optimum
names them; ``dynamo=True`` (``--dynamo``): torch's dynamo exporter (opset 18 or more) with the same inputs, outputs
and dynamic dims. ``export(model, path)`` takes a loaded ``LlamaForCausalLM``-like model; ``tiny_llama(...)`` builds
a small random one (tests; ``attn="sdpa"`` spells attention as optimum's exports do). Command line:
``python samples/export_causal_lm.py MODEL_DIR_OR_GGUF OUT.onnx [--dynamo]`` (a transformers folder, or a .gguf
file loaded through transformers' gguf support).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile


def tiny_llama(layers=2, hidden=64, intermediate=176, heads=4, kv_heads=2, vocab=1024, tie=True, seed=0,
               attn="eager"):
    """A small random LlamaForCausalLM (fp32; ``attn``: "eager" or "sdpa", the attention optimum exports)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=512, tie_word_embeddings=tie)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def _wrapper(model):
    import torch
    from transformers.cache_utils import DynamicCache

    class Step(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m, self.n = m, m.config.num_hidden_layers

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=self.m.config)
            for i in range(self.n):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return Step(model).eval()


def io_names(layers: int):
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    ins = ["input_ids", "attention_mask", "position_ids"] + past
    outs = ["logits"] + [n.replace("past_key_values", "present") for n in past]
    return ins, outs


def _dynamo_shapes(layers: int):
    """torch.export's dynamic dims for (input_ids, attention_mask, position_ids, past): B, S, P + S (its own dim:
    torch.export cannot add two dims) and P."""
    from torch.export import Dim
    b, s, total, p = Dim("batch_size"), Dim("sequence_length"), Dim("total_length"), Dim("past_sequence_length")
    return ({0: b, 1: s}, {0: b, 1: total}, {0: b, 1: s}, tuple({0: b, 2: p} for _ in range(2 * layers)))


def export(model, path: str, opset: int = 17, external_data: bool | None = None, dynamo: bool = False) -> None:
    """Exports ``model`` (a transformers causal LM with a DynamicCache-style forward) to ``path``; ``dynamo``:
    with torch's dynamo exporter (opset at least 18)."""
    import onnx
    import torch
    cfg = model.config
    layers = cfg.num_hidden_layers
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    past_len, seq = 3, 2
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    mask = torch.ones(1, past_len + seq, dtype=torch.int64)
    pos = torch.arange(past_len, past_len + seq).unsqueeze(0)
    past = [torch.randn(1, kv, past_len, head_dim, dtype=dtype) for _ in range(2 * layers)]
    ins, outs = io_names(layers)
    total = "past_sequence_length + sequence_length"
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: total},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"}}
    for n in ins[3:]:
        axes[n] = {0: "batch_size", 2: "past_sequence_length"}
    for n in outs[1:]:
        axes[n] = {0: "batch_size", 2: total}
    tmp = tempfile.mkdtemp(prefix=".export-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with torch.no_grad():
            if dynamo:
                prog = torch.onnx.export(_wrapper(model), (ids, mask, pos, *past), input_names=ins,
                                         output_names=outs, dynamic_shapes=_dynamo_shapes(layers),
                                         opset_version=max(opset, 18), dynamo=True)
                m = prog.model_proto
            else:
                torch.onnx.export(_wrapper(model), (ids, mask, pos, *past), os.path.join(tmp, "m.onnx"),
                                  input_names=ins, output_names=outs, dynamic_axes=axes, opset_version=opset,
                                  dynamo=False, do_constant_folding=True)
                m = onnx.load(os.path.join(tmp, "m.onnx"))
        big = m.ByteSize() > (1 << 30) if external_data is None else external_data
        for f in (path, path + ".data"):
            if os.path.exists(f):
                os.unlink(f)
        if big:
            onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=os.path.basename(path) + ".data", size_threshold=1024)
        else:
            onnx.save_model(m, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(path: str):
    """A LLaMA-family causal LM from a .gguf file, dequantised to fp32 (transformers' GGUF reader and the gguf
    package; without accelerate, which transformers' from_pretrained(gguf_file=...) asks for)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    cfg = dict(load_gguf_checkpoint(path)["config"])
    model_type = cfg.pop("model_type", "llama")
    config = AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{path}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def load(source: str):
    """A causal LM from a transformers folder or a .gguf file (fp32, eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM
    if source.endswith(".gguf"):
        return load_gguf(source)
    return AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager", dtype=torch.float32).eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a transformers model folder, or a .gguf file")
    p.add_argument("output", help="the .onnx file to write")
    p.add_argument("--dynamo", action="store_true", help="torch's dynamo exporter (opset 18) instead of TorchScript")
    a = p.parse_args(argv)
    export(load(a.source), a.output, opset=18 if a.dynamo else 17, dynamo=a.dynamo)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
