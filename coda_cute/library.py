"""The ready programs in ``epilogues/``, the shipped ``templates/``, and finding a program by
the reference a user types (``resolve``: a library name, ``path/to/file.py:name`` or
``package.module:name``).

Both folders sit at the top of the checkout and ship in the wheel as
``coda_cute.epilogues`` / ``coda_cute.templates``; ``resource_dir`` finds them either way
(installed package, or a checkout put on ``PYTHONPATH``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from functools import lru_cache
from pathlib import Path

from .errors import ProgramError
from .frontend import FILE_MODULE_PREFIX
from .program import Program


def resource_dir(name: str) -> Path:
    """Folder of the shipped ``templates`` or ``epilogues``."""
    spec = importlib.util.find_spec(f"coda_cute.{name}")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    checkout = Path(__file__).resolve().parent.parent / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"coda-cute {name}/ not found (broken installation?)")


@lru_cache(maxsize=1)
def programs() -> dict[str, Program]:
    """Every Program defined at the top level of a module in ``epilogues/``, by name."""
    found: dict[str, Program] = {}
    for path in _modules():
        module = _load(path)
        for value in vars(module).values():
            if isinstance(value, Program):
                if value.name in found and found[value.name] is not value:
                    raise ProgramError(f"two library programs are named {value.name!r} ({path.name})")
                found[value.name] = value
    return dict(sorted(found.items()))


def get(name: str) -> Program:
    """The library program called ``name``, or an error listing the available ones.  Until the
    whole library is loaded, the module whose source defines ``name`` is loaded first, alone:
    tracing every program costs a process that needs one kernel more than finding it."""
    if programs.cache_info().currsize == 0:
        defines = re.compile(rf"^(def {re.escape(name)}\(|{re.escape(name)} *=)", re.MULTILINE)
        for path in _modules():
            if defines.search(path.read_text()):
                program = vars(_load(path)).get(name)
                if isinstance(program, Program) and program.name == name:
                    return program
                break
    table = programs()
    if name not in table:
        raise ProgramError(f"no library program named {name!r}; available: {', '.join(table)}")
    return table[name]


def _modules() -> list[Path]:
    """The library's modules in ``epilogues/``, in order (files starting with _ are not)."""
    return [p for p in sorted(resource_dir("epilogues").glob("*.py")) if not p.name.startswith("_")]


def _load(path: Path):
    module_name = f"coda_cute.epilogues.{path.stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def resolve(reference: str) -> Program:
    """The program ``reference`` names: a library program (``swiglu``), a module-level program
    in a Python file (``path/to/file.py:name``) or in an importable module
    (``package.module:name``).  A file is run as a module, as ``python file.py`` would run it.
    Raises ProgramError naming what is missing or what the name holds instead."""
    if not isinstance(reference, str) or not reference:
        raise ProgramError(f"program reference {reference!r}: expected a library name, FILE.py:NAME or MODULE:NAME")
    if ":" not in reference:
        return get(reference)
    where, _, attribute = reference.rpartition(":")
    if not where or not attribute:
        raise ProgramError(f"program reference {reference!r}: expected FILE.py:NAME or MODULE:NAME")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(Path(where), reference)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ProgramError(f"program reference {reference!r}: cannot import module {where!r} ({exc})") from None
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            found = sorted(k for k, v in vars(module).items() if isinstance(v, Program))
            raise ProgramError(f"program reference {reference!r}: {where} has no {attribute!r}; its programs: "
                               f"{', '.join(found) or 'none'}")
        value = getattr(value, part)
    if not isinstance(value, Program):
        raise ProgramError(f"program reference {reference!r}: {attribute!r} holds a {type(value).__name__}, not "
                           "a program (define it with @coda_cute.epilogue)")
    return value


def _load_file(path: Path, reference: str):
    if not path.is_file():
        raise ProgramError(f"program reference {reference!r}: no file {str(path)!r}")
    path = path.resolve()
    name = FILE_MODULE_PREFIX + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        if isinstance(exc, ProgramError):
            raise
        raise ProgramError(f"program reference {reference!r}: running {path} failed: "
                           f"{type(exc).__name__}: {exc}") from exc
    return module
