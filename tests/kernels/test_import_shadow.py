"""The repository root on sys.path must not make our `kernels/` folder stand in for PyPI's `kernels`."""
import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _import_kernels_from_root() -> subprocess.CompletedProcess:
    code = ("import sys; sys.path.insert(0, %r)\n"
            "try:\n    import kernels\nexcept ModuleNotFoundError as e:\n    print('missing', e.name)\n"
            "else:\n    print('found', kernels.__file__)\n" % str(ROOT))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_top_level_kernels_is_the_installed_package_or_missing():
    done = _import_kernels_from_root()
    assert done.returncode == 0, done.stderr
    kind, where = done.stdout.split(maxsplit=1)
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if installed:
        assert kind == "found" and Path(where.strip()).resolve().parents[1] != ROOT
    else:
        assert (kind, where.strip()) == ("missing", "kernels")


def test_transformers_imports_with_the_root_on_sys_path():
    code = "import sys; sys.path.insert(0, %r); import transformers.integrations.hub_kernels" % str(ROOT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
