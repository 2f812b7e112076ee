"""CuTe-DSL spellings that the lowering and every backend share: the dtypes' names and sizes,
and how a reduction starts and folds in a value."""

from __future__ import annotations

CUTE_DTYPES = {"bf16": "BFloat16", "f16": "Float16", "f32": "Float32", "i32": "Int32"}
DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4}
IDENTITY = {"sum": "0.0", "sumsq": "0.0", "max": '-float("inf")', "maxabs": "0.0"}


def reduce_term(kind: str, value: str) -> str:
    """What a reduction of ``kind`` folds in for ``value``."""
    return {"sum": value, "max": value, "sumsq": f"{value} * {value}", "maxabs": f"cute.math.abs({value})"}[kind]


def combine(kind: str, a: str, b: str) -> str:
    """Two partial results of a reduction of ``kind``, folded: a max is NaN where either is, as
    torch.amax's is."""
    return f"{a} + {b}" if kind in ("sum", "sumsq") else f"cute.math.max({a}, {b}, propagate_nan=True)"
