"""Text a user writes never runs as code: every text field of a program (names, hints, docstrings,
constants, widths, dtypes) and of a kernel config, built through every path (the decorator,
``Program(...)`` by hand, ``with_constants``, config fields), carries payloads that try to end a
string or a comment and run code.  Each is refused with a coda-cute error before any source
exists, or the rendered source parses, quotes the text as written, and runs no payload when the
module is imported (the module body runs then, as it does before every compile)."""

import ast
from fractions import Fraction
from pathlib import Path

import pytest

import coda_cute as cc
from coda_cute import library
from coda_cute.compile import import_source
from coda_cute.config import KernelConfig
from coda_cute.errors import CodaError, ProgramError
from coda_cute.program import Node, Operand, Output, Program
from coda_cute.render import emit


def payloads(marker: Path) -> list[str]:
    run = f"__import__('os').system('touch {marker}')"
    return [
        f'x"""; {run}; """',  # closes the module docstring
        f"x'''; {run}; '''",
        f'"""\n{run}\n"""',
        f"a\n{run}\n",  # a newline ending a comment or a docstring line
        f"a\r{run}",
        f"a\u2028{run}",  # a line break to str.splitlines, not to Python
        "\\N{BULLET} \\x4 \\u12 \\",  # escapes a plain string literal cannot parse
        f'\\"""; {run}; #',
        "a\x00b",
        f"{{{{ {run} }}}} {{% if 1 %}}{{% endif %}}",  # Jinja syntax is data, not template
        "名前 ✓ é",
        "x" * 300,
    ]


def _no_payload_ran(source: str, doc: str | None, marker: Path, tmp_path: Path) -> None:
    tree = ast.parse(source)
    if doc is not None:
        first = doc.strip().splitlines()[0] if doc.strip() else ""
        listing = " ".join(ast.get_docstring(tree, clean=False).split())  # long lines wrap at spaces
        assert " ".join(first.split()) in listing, "the listing quotes the docstring as written"
    import_source(source, tmp_path / "src")  # runs the module body
    assert not marker.exists(), "a payload ran"


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "MARKER"


def test_docstrings_are_quoted_never_run(marker, tmp_path):
    for i, text in enumerate(payloads(marker)):
        program = Program("p", [], [Output("D", Node("acc", width=Fraction(1)))], doc=text)
        _no_payload_ran(emit(program, KernelConfig()), text, marker, tmp_path)

        def traced(acc):
            return acc

        traced.__doc__ = text
        program = cc.epilogue(traced)
        _no_payload_ran(emit(program, KernelConfig()), text, marker, tmp_path)


def test_every_name_field_refuses_payloads(marker):
    acc = Node("acc", width=Fraction(1))
    for text in payloads(marker):
        cases = {
            "program name": lambda: Program(text, [], [Output("D", acc)]),
            "operand name": lambda: Program("p", [Operand(text, "col", Fraction(1))], [Output("D", acc)]),
            "output name": lambda: Program("p", [], [Output(text, acc)]),
            "hint": lambda: Program("p", [], [Output("D", Node("neg", (acc,), (), "f32", Fraction(1), hint=text))]),
            "load name": lambda: Program("p", [], [Output("D", Node("load", (), (text,), "f32", Fraction(1)))]),
            "constant": lambda: Program("p", [], [Output("D", Node("add", (acc, Node("const", (), (text,))),
                                                                    (), "f32", Fraction(1)))]),
            "cast dtype": lambda: Program("p", [], [Output("D", Node("cast", (acc,), (text,), "f32", Fraction(1)))]),
            "output dtype": lambda: Program("p", [], [Output("D", acc, text)]),
            "reduction": lambda: Program("p", [], [Output("s", acc, None, text, "row")]),
            "op": lambda: Program("p", [], [Output("D", Node(text, (acc,), (), "f32", Fraction(1)))]),
            "decorator name": lambda: cc.epilogue(lambda acc: acc, name=text),
            "constant value": lambda: library.get("qk_rmsnorm").with_constants(eps=text),
        }
        for field, build in cases.items():
            with pytest.raises(ProgramError):
                build()
                pytest.fail(f"{field} {text!r} was accepted")


def test_hand_built_nodes_are_checked_like_traced_ones():
    acc = Node("acc", width=Fraction(1))
    bad = {
        "node op 'softplus' is unknown": Node("softplus", (acc,), (), "f32", Fraction(1)),
        "constant NaN": Node("add", (acc, Node("const", (), (float("nan"),), "f32")), (), "f32", Fraction(1)),
        "'x\\\\nimport os' is not a safe identifier": Node("neg", (acc,), (), "f32", Fraction(1), hint="x\nimport os"),
        "do not follow from its op": Node("neg", (acc,), (), "i32", Fraction(1)),
        "takes 1 argument": Node("exp", (acc, acc), (), "f32", Fraction(1)),
        "must be a tuple of nodes": Node("neg", ("acc",), (), "f32", Fraction(1)),
        "pair 2 of": Node("pair", (acc,), (2,), "f32", Fraction(1, 2)),
        "is 4\\*N wide": Node("col", (), (), "i32", Fraction(4)),
    }
    for message, node in bad.items():
        with pytest.raises(ProgramError, match=message):
            Program("p", [], [Output("D", node if node.dtype != "i32" else Node("cast", (node,), ("f32",),
                                                                                     "f32", node.width))])


def test_a_built_program_cannot_be_changed():
    program = library.get("gemm")
    with pytest.raises(AttributeError, match="cannot be changed"):
        program.doc = '"""; import os'


@pytest.mark.parametrize("field,value", [
    ("operand_dtypes", (("bias", 'f32"""; import os'),)),
    ("operand_dtypes", (("bias", "f32"), "x")),
    ("table_periods", (("cos", "1) or __import__('os')"),)),
    ("table_periods", (("cos", -4),)),
    ("tile", "128x256"),
    ("gpu", ["H200"]),
    ("majors", 12),
    ("ab_stages", "4"),
])
def test_config_fields_refuse_anything_but_their_values(field, value):
    with pytest.raises(CodaError):
        emit(library.get("bias_gelu"), KernelConfig().with_(**{field: value}))
