"""Program fingerprints: stable across traces and processes, sensitive to everything that shapes a kernel."""

import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import coda_cute as cc
from coda_cute import library
from coda_cute.primitives import ELEMENTWISE
from coda_cute.program import REDUCTIONS

ROOT = Path(__file__).resolve().parent.parent

# A program touching most node kinds (pairs, tables, coordinates, casts, infinities,
# segment and output reductions), defined from source so another process can build it too.
SAMPLE_SOURCE = '''
import math
import coda_cute as cc

@cc.epilogue
def sample(acc, bias: cc.ColVec, rstd: cc.RowVec, cos: cc.Table["N/2"], *, eps=1e-6, cols=48):
    """Sample program for fingerprint tests."""
    x0, x1 = cc.pairs(acc + bias)
    rot = cc.where(x0.col < cols // 2, x0 * cos - x1, x0)
    h = cc.interleave(rot, x1) * rstd
    return {"D": h.to(cc.bf16), "ss": cc.row_sumsq(h), "m": cc.col_max(cc.maximum(h, -math.inf)),
            "q": h * cc.rsqrt(cc.row_sumsq(h, segment=8) / 8 + eps)}
'''

CHILD = '''
import json, sys
sys.path.insert(0, sys.argv[1])
from coda_cute import library
namespace = {}
exec(sys.argv[2], namespace)
sample = namespace["sample"]
print(json.dumps({"library": {name: p.fingerprint for name, p in library.programs().items()},
                  "sample": sample.fingerprint, "variant": sample.with_constants(eps=1e-5).fingerprint}))
'''


def build_sample():
    namespace: dict = {}
    exec(SAMPLE_SOURCE, namespace)
    return namespace["sample"]


def fp(fn, **constants) -> str:
    return cc.epilogue(fn, name="prog", **constants).fingerprint


def bind(f, *args):
    """``lambda acc: f(acc, *args)`` with args fixed now (parameters of a program are operands)."""
    return lambda acc: f(acc, *args)


def all_distinct(fingerprints) -> bool:
    fingerprints = list(fingerprints)
    return len(set(fingerprints)) == len(fingerprints)


# --------------------------------------------------------------------------- stability
def test_fingerprint_is_sha256_of_canonical_json():
    sample = build_sample()
    assert sample.fingerprint == hashlib.sha256(sample.canonical().encode()).hexdigest()
    assert len(sample.fingerprint) == 64
    json.loads(sample.canonical())


def test_same_program_traced_twice():
    first, second = build_sample(), build_sample()
    assert first is not second and first.nodes[0] is not second.nodes[0]
    assert first.canonical() == second.canonical()
    assert first.fingerprint == second.fingerprint
    assert first.with_constants().fingerprint == first.fingerprint
    assert first.with_constants(eps=1e-6, cols=48).fingerprint == first.fingerprint  # the defaults again
    for name, prog in library.programs().items():
        retraced = cc.epilogue(prog.fn, name=name, a_transform=prog.a_transform)
        assert retraced.fingerprint == prog.fingerprint, name


def test_same_fingerprints_in_another_process():
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), SAMPLE_SOURCE], capture_output=True, text=True,
                          env=env, cwd=str(ROOT.parent), timeout=120)
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    sample = build_sample()
    assert theirs["sample"] == sample.fingerprint
    assert theirs["variant"] == sample.with_constants(eps=1e-5).fingerprint
    assert theirs["library"] == {name: p.fingerprint for name, p in library.programs().items()}


def test_library_fingerprints_are_distinct():
    programs = library.programs()
    assert len(programs) >= 14
    assert all_distinct(p.fingerprint for p in programs.values())
    variants = [library.get("qk_rmsnorm").with_constants(head_dim=h).fingerprint for h in (64, 128, 256)]
    assert all_distinct(variants + [p.fingerprint for p in programs.values() if p.name != "qk_rmsnorm"])


# --------------------------------------------------------------------------- sensitivity
def test_with_constants_changes_it():
    sample = build_sample()
    variants = [sample, sample.with_constants(eps=1e-5), sample.with_constants(cols=32),
                sample.with_constants(eps=1e-5, cols=32), sample.with_constants(eps=0), sample.with_constants(eps=-0.0),
                sample.with_constants(eps=0.0), sample.with_constants(eps=math.inf)]
    assert all_distinct(v.fingerprint for v in variants)
    rope = library.get("rope_qkv")
    assert rope.with_constants(rotary_cols=4096).fingerprint != rope.fingerprint
    assert cc.epilogue(eps=1e-5)(library.get("qk_rmsnorm").fn).fingerprint == \
        library.get("qk_rmsnorm").with_constants(eps=1e-5).fingerprint


@pytest.mark.parametrize("pair", [
    (lambda acc: acc * 2.0, lambda acc: acc * 3.0),
    (lambda acc: acc * 2, lambda acc: acc * 2.0),  # int vs float constant
    (lambda acc: acc + 0.0, lambda acc: acc + -0.0),
    (lambda acc: acc * 1e-6, lambda acc: acc * 1.0000000000000002e-6),  # one ulp apart
    (lambda acc: cc.maximum(acc, math.inf), lambda acc: cc.maximum(acc, -math.inf)),
    (lambda acc: acc * (2**31 - 1), lambda acc: acc * (2**31 - 2)),
], ids=["value", "int-float", "signed-zero", "one-ulp", "inf-sign", "int32"])
def test_any_constant_changes_it(pair):
    assert fp(pair[0]) != fp(pair[1])


def test_cast_target_and_output_dtype_change_it():
    outputs = [lambda acc: acc, lambda acc: acc.to(cc.bf16), lambda acc: acc.to(cc.f16), lambda acc: acc.to(cc.f32),
               lambda acc: acc.to(cc.input_dtype)]
    middles = [bind(lambda acc, t: (acc.to(t) * 2.0).to(cc.f32), t) for t in (cc.bf16, cc.f16, cc.f32, cc.input_dtype)]
    assert all_distinct(fp(f) for f in outputs + middles)


def test_every_op_changes_it():
    unary = [getattr(cc, op) for op in ("exp", "log", "sqrt", "rsqrt", "tanh", "erf", "sigmoid", "relu", "gelu",
                                        "gelu_tanh", "silu", "square")]
    prints = [fp(bind(lambda acc, f: f(acc), f)) for f in unary]
    prints += [fp(lambda acc: -acc), fp(lambda acc: abs(acc))]
    binary = [lambda x, y: x + y, lambda x, y: x - y, lambda x, y: y - x, lambda x, y: x * y, lambda x, y: x / y,
              lambda x, y: y / x, cc.minimum, cc.maximum]
    prints += [fp(bind(lambda acc, f: f(acc, acc * 0.5), f)) for f in binary]
    compare = [lambda x, y: x < y, lambda x, y: x <= y, lambda x, y: x > y, lambda x, y: x >= y,
               lambda x, y: x == y, lambda x, y: x != y]
    prints += [fp(bind(lambda acc, f: cc.where(f(acc, 0.5), acc, 0.0), f)) for f in compare]
    prints += [fp(lambda acc: cc.where(acc > 0.5, 0.0, acc)),  # branches swapped
               fp(lambda acc: cc.where((acc > 0) & (acc < 1), acc, 0.0)),
               fp(lambda acc: cc.where((acc > 0) | (acc < 1), acc, 0.0)),
               fp(lambda acc: cc.where(~(acc > 0), acc, 0.0)),
               fp(lambda acc: acc + (acc.col // 2)), fp(lambda acc: acc + (acc.col % 2)), fp(lambda acc: acc + acc.row)]
    assert all_distinct(prints)
    assert len(prints) >= len(ELEMENTWISE)


def test_pairs_interleave_and_segments_change_it():
    def interleave(swap):
        def prog(acc):
            x0, x1 = cc.pairs(acc)
            return cc.interleave(x1, x0) if swap else cc.interleave(x0, x1)
        return prog

    prints = [fp(lambda acc: cc.pairs(acc)[0]), fp(lambda acc: cc.pairs(acc)[1]), fp(interleave(False)),
              fp(interleave(True)), fp(lambda acc: cc.interleave(acc, acc))]
    prints += [fp(bind(lambda acc, k, s: acc - cc.reduce(acc, k, "row", segment=s), k, s))
               for k, s in itertools.product(REDUCTIONS, (4, 8))]
    assert all_distinct(prints)


def _operand_program(kind):
    def prog(acc, v: kind):
        return acc * v
    return prog


def _half_operand_program(kind):
    def prog(acc, v: kind):
        return cc.pairs(acc)[0] * v
    return prog


def test_operand_kind_width_and_name_change_it():
    prints = [fp(_operand_program(k)) for k in (cc.RowVec, cc.ColVec, cc.Tile, cc.Scalar, cc.Table)]
    prints += [fp(_half_operand_program(k)) for k in (cc.ColVec["N/2"], cc.Tile["N/2"], cc.Table["N/2"])]

    def wide(acc, t: cc.Tile["2N"]):
        return cc.pairs(t)[0] * acc

    def wide_col(acc, t: cc.ColVec["2N"]):
        return cc.pairs(t)[0] * acc

    def renamed(acc, w: cc.ColVec):
        return acc * w

    prints += [fp(wide), fp(wide_col), fp(renamed)]
    assert all_distinct(prints)


def test_output_names_and_reductions_change_it():
    prints = [fp(lambda acc: {"D": acc}), fp(lambda acc: {"E": acc}), fp(lambda acc: {"D": acc, "E": acc * 2.0}),
              fp(lambda acc: {"E": acc, "D": acc * 2.0})]
    prints += [fp(bind(lambda acc, k, a: {"D": acc, "r": cc.reduce(acc, k, a)}, k, a))
               for k, a in itertools.product(REDUCTIONS, ("row", "col"))]
    prints += [fp(lambda acc: {"D": acc, "s": cc.row_sum(acc * 2.0)}), fp(lambda acc: {"D": acc, "t": cc.row_sum(acc)})]
    assert all_distinct(prints)
