"""The flow runs one way: the package's docstring lists its modules in flow order, and each
module imports only modules listed before it.  So there is no import cycle, the package's
``__init__`` included, and importing a module loads nothing listed after it.

Checked from the source (every ``import`` statement of every module, those inside functions
too: they run later, but they run) and live, in one fresh interpreter that imports the modules
in order and after each one looks at what is loaded.  Importing in order finds what a fresh
interpreter per module would: a module that drags in one listed after it does so at its own
import, when that one is not loaded yet."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "coda_cute"
SOURCE = ROOT / PACKAGE


def _listed() -> list[list[str]]:
    """The docstring's lines ``- ``name``, ``name``  what they do``: full module names, per line."""
    doc = ast.get_docstring(ast.parse((SOURCE / "__init__.py").read_text()))
    lines = re.findall(r"^- ((?:``[\w.]+``, )*``[\w.]+``)", doc, re.M)
    return [[f"{PACKAGE}.{name}" for name in re.findall(r"``([\w.]+)``", line)] for line in lines]


LINES = _listed()
ORDER = [name for line in LINES for name in line]
LANGUAGE = set(LINES[0])  # what `import coda_cute` loads (its __init__ runs before any module)


def _files() -> dict[str, Path]:
    """Every module of the package by full name (a subpackage by its own name), ``__init__`` too."""
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


FILES = _files()


def _imports(name: str) -> list[tuple[str, int, bool]]:
    """(module imported, line, whether at module level) for each package module ``name`` imports;
    ``from . import x`` imports the module ``x`` where there is one, else the package itself."""
    path = FILES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in FILES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in FILES:  # `import coda_cute.x.y` of a name inside a module
                target = target.rpartition(".")[0]
            if target:
                found.append((target, node.lineno, id(node) in top))
    return found


def test_every_module_is_listed_once():
    modules = set(FILES) - {PACKAGE}
    assert len(ORDER) == len(set(ORDER)), f"listed twice: {sorted({m for m in ORDER if ORDER.count(m) > 1})}"
    assert not modules - set(ORDER), (f"{sorted(modules - set(ORDER))} not in the package docstring's list: "
                                      "add each where it belongs in the flow")
    assert not set(ORDER) - modules, f"listed but not in the package: {sorted(set(ORDER) - modules)}"


def test_modules_import_only_modules_listed_before_them():
    wrong = []
    for name in ORDER:
        for target, line, _ in _imports(name):
            if target == PACKAGE:
                wrong.append(f"{name}:{line} imports the package, whose __init__ may import anything: "
                             "import the module that defines the name")
            elif target not in ORDER or ORDER.index(target) >= ORDER.index(name):
                wrong.append(f"{name}:{line} imports {target}, listed after it")
    assert not wrong, "\n".join(wrong)


def test_the_package_loads_only_the_language():
    """``coda_cute/__init__.py`` runs before any module of the package is imported, so at module
    level it imports only the docstring's first line; the rest of its names come on first use."""
    eager = {target for target, _, at_top in _imports(PACKAGE) if at_top}
    assert eager <= LANGUAGE, f"the package's __init__ imports {sorted(eager - LANGUAGE)} when it is imported"


def test_no_import_cycle():
    graph = {name: sorted({target for target, _, _ in _imports(name)}) for name in FILES}
    done, path = set(), []

    def visit(name):
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for target in graph[name]:
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in graph:
        cycle = visit(name)
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


_PROBE = r"""
import importlib, json, sys
loaded = lambda: sorted(m for m in sys.modules if m == "coda_cute" or m.startswith("coda_cute."))
import coda_cute
report = {"file": coda_cute.__file__, "coda_cute": loaded()}
for name in json.loads(sys.argv[1]):
    module = importlib.import_module(name)
    if name == "coda_cute.library":
        module.programs()  # runs the epilogue files, which import the package
    report[name] = loaded()
print(json.dumps(report))
"""


def test_importing_a_module_loads_nothing_listed_after_it():
    result = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(ORDER)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(report.pop("file")).resolve() == SOURCE / "__init__.py"
    allowed = LANGUAGE | {PACKAGE}
    more = sorted(set(report.pop(PACKAGE)) - allowed)
    wrong = [f"import coda_cute loads {more}, beyond the docstring's first line"] if more else []
    for name in ORDER:
        allowed.add(name)
        later = sorted(m for m in report[name] if m in FILES and m not in allowed)
        if later:
            wrong.append(f"importing {name} loads {later}, listed after it")
    assert not wrong, "\n".join(wrong)
