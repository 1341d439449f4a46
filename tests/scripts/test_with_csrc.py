"""scripts/with_csrc.py: a command or script runs with the native kernels' sources taken from another folder."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "with_csrc.py"


def _run(*args, cwd):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_a_script_sees_the_other_folders_sources(tmp_path):
    other = tmp_path / "old"
    shutil.copytree(ROOT / "kernels" / "csrc", other)
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nfrom llmopt.kernels import cpu_native\n"
                     "print(sorted({str(p.parent) for p in cpu_native.SOURCES + cpu_native.HEADERS}), sys.argv[1:])\n")
    done = _run(other, "--", probe, "a", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{[str(other)]} ['a']"


def test_a_folder_missing_a_source_is_refused_in_one_line(tmp_path):
    other = tmp_path / "old"
    shutil.copytree(ROOT / "kernels" / "csrc", other)
    (other / "layer.c").unlink()
    done = _run(other, "--", "--version", cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.strip() == f"{other}: missing layer.c"


def test_an_llmopt_command_runs(tmp_path):
    done = _run(ROOT / "kernels" / "csrc", "--", "--version", cwd=tmp_path)
    assert done.returncode == 0 and "llmopt" in done.stdout
