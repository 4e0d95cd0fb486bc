"""What users install is what is tested: an sdist and a wheel built from a clean
copy of the tracked files install and work outside the checkout.

The editable install the rest of the suite runs on imports from the checkout
itself, so it hides a subpackage the build leaves out or a source an sdist does
not carry. Here the tracked files are copied to a scratch folder; from it an
sdist and a wheel are built (``pip wheel .`` is what ``pip install .`` runs),
the sdist is installed the way ``pip install unimem-X.tar.gz`` does (it builds a
wheel of its own), and each goes into a fresh environment whose only way to
the dependencies is a path to this environment's site-packages (whose own
``.pth`` files, the editable install's among them, are not run). Builds use
this environment's setuptools and Cython (no isolation: no network needed).
"""
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile

import pytest

from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.timeout(1200)

# What an sdist needs beside the package to build, and the documents that ship.
SDIST_TOP_LEVEL = ["LICENSE", "MANIFEST.in", "README.md", "SECURITY.md", "_unimem_opencl.py",
                   "pyproject.toml", "setup.py"]

# Run inside each installed environment, from a folder outside the checkout.
CHECK_INSTALLED = textwrap.dedent("""
    import importlib, json, os, pkgutil, sys
    import unimem
    where = os.path.realpath(unimem.__file__)
    modules = sorted(m.name for m in pkgutil.walk_packages(unimem.__path__, "unimem."))
    for name in modules:
        importlib.import_module(name)
    import unimem.cpu
    before = unimem.cpu.memory_allocated(0)
    p = unimem.cpu.caching_allocator_alloc(1000, 0)
    allocated = unimem.cpu.memory_allocated(0) - before
    unimem.cpu.caching_allocator_delete(p)
    print(json.dumps({"file": where, "prefix": os.path.realpath(sys.prefix), "modules": modules,
                      "allocated": allocated, "after_free": unimem.cpu.memory_allocated(0) - before}))
""")


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return sorted(p for p in out.decode().split("\0") if p and os.path.isfile(REPO_ROOT / p))


def module_name(path):
    """unimem/_runtime/registry.pyx -> unimem._runtime.registry"""
    stem = path.rsplit(".", 1)[0]
    name = stem.replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def run(*args, cwd, env=None):
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(map(str, args))} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return result


def fresh_environment(root):
    """A venv without pip whose only path to the dependencies is this
    environment's site-packages, added by a plain path line (pip itself comes
    from there too)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return python


def clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "UNIMEM_"))}
    env["PIP_NO_INDEX"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["UNIMEM_DEVICE"] = "cpu"
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    files = tracked_files()
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    for path in files:
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        with open(REPO_ROOT / path, "rb") as src, open(source / path, "wb") as dst:
            dst.write(src.read())
    env = clean_env()
    run(sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", tmp / "dist", source,
        cwd=tmp, env=env)
    (sdist,) = (tmp / "dist").glob("*.tar.gz")

    # The wheel of `pip install .` and the one installing the sdist builds,
    # compiled side by side.
    from_sdist = fresh_environment(tmp / "env-sdist")
    builds = [
        subprocess.Popen([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-w", tmp / "wheels", source], cwd=tmp, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        subprocess.Popen([from_sdist, "-m", "pip", "install", "--no-deps", "--no-build-isolation", sdist],
                         cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    ]
    for build in builds:
        output = build.communicate()[0]
        assert build.returncode == 0, f"{build.args} failed:\n{output[-8000:]}"
    (wheel,) = (tmp / "wheels").glob("*.whl")
    from_wheel = fresh_environment(tmp / "env-wheel")
    run(from_wheel, "-m", "pip", "install", "--no-deps", wheel, cwd=tmp, env=env)
    return {"files": files, "sdist": sdist, "wheel": wheel, "tmp": tmp, "env": env,
            "pythons": {"wheel": from_wheel, "sdist": from_sdist}}


def package_files(files):
    return [p for p in files if p.startswith("unimem/")]


def test_the_sdist_holds_every_source_the_build_needs_and_no_build_output(built):
    with tarfile.open(built["sdist"]) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n[len(top) + 1:] for n in tar.getnames()}
    missing = [p for p in package_files(built["files"]) + SDIST_TOP_LEVEL if p not in names]
    assert not missing, f"the sdist lacks {missing}"
    outputs = sorted(n for n in names if n.endswith((".so", ".cpp", ".pyc")))
    assert not outputs, f"the sdist carries build outputs: {outputs}"


def test_the_wheel_holds_every_file_of_the_package_and_a_compiled_module_for_each_pyx(built):
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = set(whl.namelist())
    missing = [p for p in package_files(built["files"]) if p not in names]
    assert not missing, f"the wheel lacks {missing}"
    compiled = {module_name(n.split(".cpython")[0] + ".so") for n in names if n.endswith(".so")}
    uncompiled = [p for p in package_files(built["files"])
                  if p.endswith(".pyx") and module_name(p) not in compiled
                  and not (p == "unimem/_integrations/sycl_interposer.pyx" and not sys.platform.startswith("linux"))]
    assert not uncompiled, f"no compiled module in the wheel for {uncompiled}"
    assert {"_unimem_opencl.py", "unimem-opencl.pth"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("benchmarks/", "tests/")) for n in names)


def test_the_wheel_declares_its_licence_in_spdx(built):
    with zipfile.ZipFile(built["wheel"]) as whl:
        (metadata,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        text = whl.read(metadata).decode()
    assert "License-Expression: BSD-3-Clause" in text.splitlines()


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_an_install_imports_every_module_and_allocates_outside_the_checkout(built, kind, tmp_path):
    python = built["pythons"][kind]
    out = run(python, "-c", CHECK_INSTALLED, cwd=tmp_path, env=built["env"]).stdout
    report = json.loads(out.strip().splitlines()[-1])
    assert report["file"].startswith(report["prefix"] + os.sep), report["file"]
    assert not report["file"].startswith(os.path.realpath(REPO_ROOT) + os.sep)
    expected = sorted({module_name(p) for p in package_files(built["files"])
                       if p.endswith((".py", ".pyx"))
                       and not (p == "unimem/_integrations/sycl_interposer.pyx" and not sys.platform.startswith("linux"))})
    assert report["modules"] == [m for m in expected if m != "unimem"]
    assert report["allocated"] == 1024 and report["after_free"] == 0


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_an_install_runs_the_command_line(built, kind, tmp_path):
    python = built["pythons"][kind]
    for command in ([python, "-m", "unimem", "--help"], [python.parent / "unimem", "--help"]):
        out = run(*command, cwd=tmp_path, env=built["env"]).stdout
        assert "usage:" in out and "demo" in out


# What runs, tests, notebooks and editors leave beside the sources of a
# working checkout: none of it goes into an sdist (or the wheel built from it).
JUNK = ["unimem/snapshot.pickle", "unimem/debug.log", "unimem/_core.pyx.orig", "unimem/.DS_Store",
        "unimem/_observe/report.py~", "unimem/memory.html", "unimem/scratch.cpp", "unimem/_core.o",
        "unimem/.hypothesis/examples/x", "unimem/__pycache__/x.cpython-311.pyc"]


def test_an_sdist_from_a_working_checkout_leaves_what_runs_and_editors_wrote_out(tmp_path):
    source = tmp_path / "source"
    for path in tracked_files():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        with open(REPO_ROOT / path, "rb") as src, open(source / path, "wb") as dst:
            dst.write(src.read())
    for path in JUNK:
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text("junk\n")
    run(sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", tmp_path / "dist", source,
        cwd=tmp_path, env=clean_env())
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert not [p for p in JUNK if p in names], sorted(p for p in JUNK if p in names)
