"""The ready programs in ``epilogues/`` and the shipped ``templates/``.

Both folders sit at the top of the checkout and ship in the wheel as
``coda_cute.epilogues`` / ``coda_cute.templates``; ``resource_dir`` finds them either way
(installed package, or a checkout put on ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

from .errors import ProgramError
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
    for path in sorted(resource_dir("epilogues").glob("*.py")):
        if path.name.startswith("_"):
            continue
        module = _load(path)
        for value in vars(module).values():
            if isinstance(value, Program):
                if value.name in found and found[value.name] is not value:
                    raise ProgramError(f"two library programs are named {value.name!r} ({path.name})")
                found[value.name] = value
    return dict(sorted(found.items()))


def get(name: str) -> Program:
    """The library program called ``name``, or an error listing the available ones."""
    table = programs()
    if name not in table:
        raise ProgramError(f"no library program named {name!r}; available: {', '.join(table)}")
    return table[name]


def _load(path: Path):
    module_name = f"coda_cute.epilogues.{path.stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
