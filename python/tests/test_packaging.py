"""The package as it is shipped (docs/PACKAGING.md): the sdist holds
libmha's sources; the wheel, built from the sdist and repaired by
auditwheel (scripts/test-python.sh, which names their folder in
MHA_TEST_DIST), is manylinux and finds every library inside itself or
among those every Linux has; the package is typed; python/README.md's
snippets run."""
import ast
import os
import platform
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import mha
from mha import _core

PYTHON_DIR = Path(__file__).resolve().parents[1]    # python/
ROOT = PYTHON_DIR.parent                            # the project's root
DIST = os.environ.get("MHA_TEST_DIST")

# What a manylinux wheel may take from the system (the manylinux policy's
# libraries that libmha's dependencies use: glibc's, and the C++ runtime
# oneDNN is written in); everything else must come inside the wheel.
SYSTEM_LIBS = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2",
               "librt.so.1", "libstdc++.so.6", "libgcc_s.so.1"}


def _one(pattern, where):
    found = sorted(Path(where).glob(pattern))
    assert len(found) == 1, "expected one %s in %s, found %s" % (
        pattern, where, [f.name for f in found])
    return found[0]


# ---- the sdist ------------------------------------------------------------


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The sdist the wheel was built from, or one built here."""
    if DIST:
        return _one("mha-*.tar.gz", DIST)
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("no pyproject.toml above the tests to build an sdist")
    out = tmp_path_factory.mktemp("sdist")
    subprocess.run([sys.executable, "-c",
                    "import sys; from scikit_build_core.build import "
                    "build_sdist; build_sdist(sys.argv[1])", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    return _one("mha-*.tar.gz", out)


def test_sdist_holds_libmha_sources(sdist):
    """Every source libmha's CMake project names, every header, the
    extension, the package and its build files are in the sdist, under
    the repository's own paths; nothing else than the listed folders."""
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    cmake = (ROOT / "CMakeLists.txt").read_text()
    named = set(re.findall(r"\b(?:src|examples|tools)/[\w/]+\.c\b", cmake))
    named = {n for n in named if not n.startswith("tools/")}  # not built
    named |= set(re.findall(r"\bcmake/[\w.]+\.in\b", cmake))
    tree = {p.relative_to(ROOT).as_posix()
            for d in ("include", "src") for p in (ROOT / d).rglob("*.[ch]")}
    need = named | tree | {
        "pyproject.toml", "CMakeLists.txt", "python/CMakeLists.txt",
        "python/README.md", "python/src/mha_core.c", "python/mha/py.typed",
        "python/mha/_core.pyi", "python/mha/__init__.py",
        "python/mha/nn/functional.py", "python/mha/transformers.py",
        "PKG-INFO"}
    assert len(named) > 30, "no sources found in CMakeLists.txt"
    assert not need - names, "missing from the sdist: %s" % sorted(
        need - names)
    top = {"pyproject.toml", "CMakeLists.txt", "PKG-INFO", "cmake",
           "include", "src", "examples", "python"}
    stray = sorted(n for n in names if n.split("/")[0] not in top or
                   n.startswith(("python/build", "python/bench")))
    assert not stray, "unexpected files in the sdist: %s" % stray[:10]


def test_default_build_stays_out_of_the_checkout():
    """No build-dir in pyproject.toml: scikit-build-core builds in a
    temporary directory, never in python/build/ as it once did."""
    toml = ROOT / "pyproject.toml"
    if not toml.is_file():
        pytest.skip("no pyproject.toml above the tests")
    tomllib = pytest.importorskip("tomllib")
    with toml.open("rb") as f:
        skb = tomllib.load(f)["tool"]["scikit-build"]
    assert "build-dir" not in skb and "build_dir" not in skb, skb


# ---- the wheel --------------------------------------------------------------


@pytest.fixture(scope="module")
def repaired():
    if not DIST:
        pytest.skip("MHA_TEST_DIST (scripts/test-python.sh) names no wheels")
    return _one("repaired/mha-*.whl", DIST)


def test_wheel_is_manylinux(repaired):
    tag = "cp%d%d-cp%d%d-manylinux_" % (sys.version_info[:2] * 2)
    assert tag in repaired.name, repaired.name
    assert repaired.name.endswith("_%s.whl" % platform.machine())
    with zipfile.ZipFile(repaired) as z:
        names = z.namelist()
        wheel = z.read("mha-%s.dist-info/WHEEL" % mha.__version__).decode()
    assert re.search(r"^Tag: cp\d+-cp\d+-manylinux_\d+_\d+_", wheel, re.M), \
        wheel
    for n in ("mha/py.typed", "mha/_core.pyi", "mha/nn/functional.py",
              "mha/transformers.py"):
        assert n in names, "%s is not in %s" % (n, repaired.name)
    assert any(re.match(r"mha/_core\..*\.so$", n) for n in names), names
    libs = [n for n in names if n.startswith("mha.libs/")]
    for lib in ("libopenblas", "libgomp", "libcjson"):
        assert any(lib in n for n in libs), "%s not bundled: %s" % (lib, libs)
    size = repaired.stat().st_size
    assert size < 40e6, "the wheel grew to %.1f MB" % (size / 1e6)


def test_wheel_needs_only_system_libc(repaired, tmp_path):
    """ldd of the repaired extension: every library inside the wheel,
    or one of SYSTEM_LIBS (and the loader)."""
    with zipfile.ZipFile(repaired) as z:
        z.extractall(tmp_path)
    core = _one("mha/_core.*.so", tmp_path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    out = subprocess.run(["ldd", str(core)], env=env, check=True,
                         capture_output=True, text=True).stdout
    outside = []
    for line in out.splitlines():
        line = line.strip()
        if not line or line.startswith(("linux-vdso", "/")) or \
                "ld-linux" in line:
            continue
        name, _, where = line.partition(" => ")
        path = where.split(" (")[0]
        if name in SYSTEM_LIBS and path.startswith("/"):
            continue
        if not os.path.realpath(path).startswith(str(tmp_path.resolve())):
            outside.append(line)
    assert not outside, "libraries from outside the wheel:\n%s" % "\n".join(
        outside)


# ---- types ----------------------------------------------------------------


def test_package_is_typed():
    """py.typed and the stub of the C extension sit beside the package,
    and the stub names exactly what the extension defines."""
    pkg = Path(mha.__file__).parent
    assert (pkg / "py.typed").is_file()
    stub = ast.parse((pkg / "_core.pyi").read_text())
    defs = {n.name: n for n in stub.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    runtime = {n for n in dir(_core)
               if not n.startswith("__") and callable(getattr(_core, n))}
    assert set(defs) == runtime, (set(defs) ^ runtime)
    for cls in ("Module", "KVCache"):
        stubbed = {n.name for n in defs[cls].body
                   if isinstance(n, ast.FunctionDef)}
        real = {n for n in vars(getattr(_core, cls))
                if not n.startswith("__")}
        assert stubbed == real, (cls, stubbed ^ real)


# ---- python/README.md -------------------------------------------------------


def _snippets():
    readme = PYTHON_DIR / "README.md"
    if not readme.is_file():
        return []
    return re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)


@pytest.mark.parametrize("code", _snippets(),
                         ids=lambda c: c.split("\n", 1)[0][:30])
def test_readme_snippet_runs(code, tmp_path):
    """Each of python/README.md's Python snippets runs as it is written
    (in a fresh interpreter, in an empty folder, on this mha)."""
    for dep in ("transformers", "torch"):
        if re.search(r"^import .*\b%s\b" % dep, code, re.M):
            pytest.importorskip(dep)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(mha.__file__).parents[1])] +
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_readme_has_the_snippets():
    assert len(_snippets()) == 3, "python/README.md's snippets went missing"
