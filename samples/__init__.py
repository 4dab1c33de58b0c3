"""Embedded sample models (installed as onnx_lowbit.samples); samples/make_samples.py rebuilds them."""
import os

DIR = os.path.dirname(os.path.abspath(__file__))


def path(name: str) -> str:
    return os.path.join(DIR, name)
