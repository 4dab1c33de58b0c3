"""Graph rewrites (onnx-graphsurgeon), one per file."""
