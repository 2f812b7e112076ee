"""Random compositions of epilogue primitives, for testing the generator against the reference.

``random_program(seed)`` builds a program from a seeded mix of operands (per-row and
per-column vectors, a tile, a scalar), elementwise ops (kept numerically tame: exp and log
see clamped or positive arguments, divisions have denominators >= 1), comparisons with
where(), output casts, pairwise transforms (N/2 outputs and back to N with interleave),
and row / column reductions as extra outputs; with ``extras``, also a table operand and a
segment reduction fed back into the value.  (No rounding casts mid-expression: a
one-ulp flip there, amplified by later ops, would make element-wise checks flaky; the
library programs cover those casts.)
"""

from __future__ import annotations

import inspect
import random

import coda_cute as cc

_UNARY = [
    lambda x: cc.relu(x), lambda x: cc.gelu(x), lambda x: cc.gelu_tanh(x), lambda x: cc.silu(x),
    lambda x: cc.sigmoid(x), lambda x: cc.tanh(x), lambda x: cc.square(x) * 0.25, lambda x: -x, lambda x: abs(x),
    lambda x: cc.exp(cc.clamp(x, -4.0, 4.0)) * 0.1, lambda x: cc.log(1.0 + abs(x)), lambda x: cc.sqrt(abs(x) + 0.5),
    lambda x: cc.rsqrt(abs(x) + 1.0), lambda x: cc.clamp(x, -1.5, 2.0),
]
_BINARY = [
    lambda x, y: x + y, lambda x, y: x - y, lambda x, y: x * y, lambda x, y: x / (1.0 + abs(y)),
    lambda x, y: cc.minimum(x, y), lambda x, y: cc.maximum(x, y), lambda x, y: cc.where(x > y, x, 0.5 * y),
]
_REDUCTIONS = [cc.row_sum, cc.row_sumsq, cc.row_max, cc.row_maxabs, cc.row_logsumexp,
               cc.col_sum, cc.col_sumsq, cc.col_max, cc.col_maxabs]


_SEGMENT_REDUCTIONS = {"sum": cc.row_sum, "sumsq": cc.row_sumsq, "max": cc.row_max, "maxabs": cc.row_maxabs,
                       "logsumexp": cc.row_logsumexp}


def random_program(seed: int, extras: bool = False) -> cc.Program:
    """The composition of ``seed``; ``extras`` adds a table (N wide, T[row % R, col % P]) and/or a
    segment reduction, drawn from a stream of their own: the program without them is unchanged."""
    rng = random.Random(seed)
    kinds = {"r": cc.RowVec, "c": cc.ColVec, "t": cc.Tile, "s": cc.Scalar, "tab": cc.Table}
    chosen = [name for name in list(kinds)[:4] if rng.random() < 0.6]
    more = random.Random(seed + 1_000_003)
    table = extras and more.random() < 0.7
    segment = None
    if extras and (not table or more.random() < 0.7):
        segment = (more.choice(sorted(_SEGMENT_REDUCTIONS)), more.choice([8, 16, 32, 64, 128]))
        chosen = [name for name in chosen if name != "t"]  # a segment reduction reads no tile operand
    if table:
        chosen.append("tab")
    steps = [(rng.randrange(len(_UNARY)), rng.randrange(len(_BINARY)), rng.random()) for _ in range(rng.randint(2, 5))]
    paired = rng.random() < 0.35
    out_dtype = rng.choice([None, cc.f32, cc.bf16])
    reduction = rng.choice([None] + _REDUCTIONS)

    def body(acc, **operands):
        table_value = operands.pop("tab", None)
        leaves = [acc] + list(operands.values())
        x = acc
        for unary, binary, pick in steps:
            other = leaves[int(pick * len(leaves))]
            x = _BINARY[binary](_UNARY[unary](x), other)
        if table_value is not None:
            x = x + 0.5 * table_value
        if segment is not None:
            kind, columns = segment
            x = x / (1.0 + abs(_SEGMENT_REDUCTIONS[kind](x, segment=columns)))
        if paired:  # a gated N/2 value, and back to N wide
            gate, up = cc.pairs(x)
            half = cc.silu(gate) * up
            outputs = {"D": half, "E": cc.interleave(half, gate - up)}
        else:
            outputs = {"D": x if out_dtype is None else x.to(out_dtype)}
        if reduction is not None:
            outputs["R"] = reduction(x)
        return outputs

    def function(acc, *args):
        return body(acc, **dict(zip(chosen, args)))

    # the traced function shows one annotated parameter per chosen operand
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    function.__signature__ = inspect.Signature(
        [inspect.Parameter("acc", positional)] + [inspect.Parameter(n, positional, annotation=kinds[n]) for n in chosen]
    )
    function.__annotations__ = {name: kinds[name] for name in chosen}
    function.__name__ = f"random_{seed}{'_extras' if extras else ''}"
    return cc.epilogue(function)


def random_programs(count: int, start: int = 0, extras: bool = False) -> list[cc.Program]:
    return [random_program(seed, extras) for seed in range(start, start + count)]
