"""The unary functions FPLUT tables approximate, as float64 numpy references."""
from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x):
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        return np.where(x >= 0, 1.0 / (1.0 + np.exp(-x)), np.exp(x) / (1.0 + np.exp(x)))


def _softplus(x):
    x = np.asarray(x, dtype=np.float64)
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def _gelu_tanh(x):
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


FUNCTIONS = {
    "silu": lambda x: np.asarray(x, np.float64) * _sigmoid(x),
    "sigmoid": _sigmoid,
    "tanh": lambda x: np.tanh(np.asarray(x, np.float64)),
    "gelu": lambda x: 0.5 * np.asarray(x, np.float64) * (1.0 + _erf(np.asarray(x, np.float64) / math.sqrt(2.0))),
    "gelu_tanh": _gelu_tanh,
    "exp": lambda x: np.exp(np.asarray(x, np.float64)),
    "softplus": _softplus,
    "elu": lambda x: np.where(np.asarray(x) > 0, np.asarray(x, np.float64), np.expm1(np.minimum(np.asarray(x, np.float64), 0.0))),
    "hardswish": lambda x: np.asarray(x, np.float64) * np.clip(np.asarray(x, np.float64) + 3.0, 0.0, 6.0) / 6.0,
    "mish": lambda x: np.asarray(x, np.float64) * np.tanh(_softplus(x)),
    "erf": lambda x: _erf(np.asarray(x, np.float64)),
    "quick_gelu": lambda x: np.asarray(x, np.float64) * _sigmoid(1.702 * np.asarray(x, np.float64)),
}


def evaluate(name: str, x) -> np.ndarray:
    """f(x) in float64 for a function of the catalogue (inputs are upcast, so fp16 inputs are exact)."""
    try:
        fn = FUNCTIONS[name]
    except KeyError:
        raise KeyError(f"unknown FPLUT function {name!r}; known: {', '.join(sorted(FUNCTIONS))}") from None
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(fn(np.asarray(x, dtype=np.float64)), dtype=np.float64)
