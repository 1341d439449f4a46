"""The repository root on sys.path must not make our `kernels/` folder stand in for PyPI's `kernels`.

Both cases are checked whatever this machine has installed: PyPI's `kernels` (Hugging Face's kernel hub, which
bitsandbytes pulls in) present, and absent (a site-packages copy without it), as on a machine with llmopt mapped
by a PYTHONPATH shim and no bitsandbytes. Whether llmopt itself is pip-installed does not matter: the root is on
sys.path either way (the shim puts it there; so does pytest, tests/ being a package).
"""
import importlib.metadata
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPI_KERNELS = any(dist.metadata["Name"] == "kernels" for dist in importlib.metadata.distributions())


def _site_without_pypi_kernels(where: Path) -> Path:
    """A copy (of links) of every site-packages folder, less PyPI's `kernels` and its metadata."""
    where.mkdir()
    for folder in [*site.getsitepackages(), site.getusersitepackages()]:
        for entry in Path(folder).glob("*") if Path(folder).is_dir() else ():
            if entry.name != "kernels" and not entry.name.startswith("kernels-") and not (where / entry.name).exists():
                (where / entry.name).symlink_to(entry)
    return where


def _run(code: str, without_pypi_kernels: Path | None = None) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter whose sys.path starts with the repository root."""
    prologue = "import sys\n"
    if without_pypi_kernels is not None:
        prologue += ("import site\nsys.path[:] = [p for p in sys.path if not p.endswith(('site-packages', "
                     "'dist-packages'))]\nsite.addsitedir(%r)\n" % str(without_pypi_kernels))
    prologue += "sys.path.insert(0, %r)\n" % str(ROOT)
    return subprocess.run([sys.executable, "-c", prologue + code], capture_output=True, text=True, timeout=300)


@pytest.fixture(params=["installed", "absent"])
def pypi_kernels(request, tmp_path):
    """None where PyPI's `kernels` is installed; else the site-packages copy without it."""
    if request.param == "installed":
        if not PYPI_KERNELS:
            pytest.skip("PyPI's kernels package is not installed here (the 'absent' case runs instead)")
        return None
    return _site_without_pypi_kernels(tmp_path / "site")


def test_top_level_kernels_is_never_our_folder(pypi_kernels):
    done = _run("try:\n    import kernels\nexcept ModuleNotFoundError as e:\n    print('missing', e.name)\n"
                "else:\n    print('found', getattr(kernels, '__file__', None))\n", pypi_kernels)
    assert done.returncode == 0, done.stderr[-2000:]
    kind, where = done.stdout.split(maxsplit=1)
    if pypi_kernels is None:
        assert kind == "found" and Path(where.strip()).resolve().parents[1] != ROOT
    else:  # missing, or a module without a file (nothing of ours runs)
        assert (kind, where.strip()) in {("missing", "kernels"), ("found", "None")}, done.stdout


def test_transformers_imports_with_the_root_on_sys_path(pypi_kernels):
    done = _run("import transformers.integrations.hub_kernels\n", pypi_kernels)
    assert done.returncode == 0, done.stderr[-2000:]
