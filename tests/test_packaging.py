"""The package works installed from its wheel, outside the checkout, and from a bare checkout
on PYTHONPATH: the library programs (epilogues/) and the template (templates/) are found
either way.  The wheel is built once for this module's tests, from a copy of the checkout
(so the build leaves no build/ or *.egg-info behind in the tree, and stale build output
cannot leak into it): ~5 s in all."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns(".git", ".*venv*", "venv", "build", "dist", "*.egg-info", "__pycache__",
                               ".pytest_cache", ".device", ".whl", "tests", "benchmarks")

# Run in a fresh interpreter; prints what it found as JSON.  ``expect_under`` is where
# coda_cute must be imported from; editable-install finders are dropped so that a
# checkout is tested as a checkout even where the package is also installed (CI).
_PROBE = r"""
import json, sys
site = sys.argv[1]
if site:
    sys.path.insert(0, site)
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
import coda_cute
from coda_cute import library
from coda_cute.cli import main
from coda_cute.config import KernelConfig
from coda_cute.render import emit

source = emit(library.get("swiglu"), KernelConfig(tile=(128, 128)))
compile(source, "swiglu.py", "exec")
status = main(["list", "--names"])
print(json.dumps({
    "file": coda_cute.__file__,
    "templates": str(library.resource_dir("templates")),
    "epilogues": str(library.resource_dir("epilogues")),
    "programs": sorted(library.programs()),
    "header": source.splitlines()[0],
    "cli_status": status,
}))
"""


def _probe(cwd: Path, site: str, pythonpath: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONWARNINGS"] = "ignore"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    result = subprocess.run([sys.executable, "-c", _PROBE, site], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _checkout_programs() -> list[str]:
    from coda_cute import library

    return sorted(library.programs())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    [built] = (tmp / "dist").glob("coda_cute-*.whl")
    return built


def test_wheel_ships_the_package_templates_and_library(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "coda_cute").rglob("*.py")}  # subpackages too
    templates = {f"coda_cute/templates/{p.name}" for p in (ROOT / "templates").glob("*.j2")}
    epilogues = {f"coda_cute/epilogues/{p.name}" for p in (ROOT / "epilogues").glob("*.py")}
    assert "coda_cute/templates/sm90_gemm.py.j2" in templates
    assert {"coda_cute/epilogues/basic.py", "coda_cute/epilogues/mlp.py"} <= epilogues
    for group in (modules, templates, epilogues):
        assert group <= names, f"missing from the wheel: {sorted(group - names)}"
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "benchmarks/"))]
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "coda-cute = coda_cute.cli:main" in zipfile.ZipFile(wheel).read(info).decode()
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for requirement in ("nvidia-cutlass-dsl", "torch", "jinja2", "apache-tvm-ffi"):
        assert f"Requires-Dist: {requirement}" in metadata


def test_installed_wheel_works_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                             str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (site / "bin" / "coda-cute").exists(), "the console script is installed"
    work = tmp_path / "elsewhere"
    work.mkdir()
    found = _probe(work, str(site), None)
    installed = (site / "coda_cute").resolve()
    assert Path(found["file"]).resolve().parent == installed, f"imported {found['file']}, not the wheel"
    assert Path(found["templates"]).resolve() == installed / "templates"
    assert Path(found["epilogues"]).resolve() == installed / "epilogues"
    assert found["programs"] == _checkout_programs()
    assert found["header"] == '"""coda-cute kernel `swiglu` for sm_90a (H200).'
    assert found["cli_status"] == 0


def test_checkout_on_pythonpath_works_without_installing(tmp_path):
    found = _probe(tmp_path, "", str(ROOT))
    assert Path(found["file"]).resolve().parent == (ROOT / "coda_cute").resolve()
    assert Path(found["templates"]).resolve() == (ROOT / "templates").resolve()
    assert Path(found["epilogues"]).resolve() == (ROOT / "epilogues").resolve()
    assert found["programs"] == _checkout_programs()
    assert found["header"] == '"""coda-cute kernel `swiglu` for sm_90a (H200).'
    assert found["cli_status"] == 0
