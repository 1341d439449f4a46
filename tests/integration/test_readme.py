"""README.md stays short, its links resolve, its quickstart runs (every command exits 0, in an empty
folder with an empty import cache), and every other command it shows parses (llmopt's, make targets).

The quickstart is the fenced ```bash block right under the "## Quickstart" heading. Each line is one
`llmopt ...` command (a trailing `# comment` is dropped); a line ending in `&` starts a server in the
background as job %1, %2, ... and `kill %1 %2` stops them with SIGTERM. Any other line fails the test, so
the README cannot show a command that nothing runs.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 220
COMMAND_TIMEOUT_S = 900
HEALTH_TIMEOUT_S = 300

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"`((?:llmopt|make) [^`]+)`")
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]+|N")  # COMMAND, DIR, N: a word the reader fills in


def quickstart_commands(text: str) -> list[list[str]]:
    """The argv of each line of the ```bash block right under '## Quickstart', comments dropped."""
    parts = re.split(r"^## Quickstart[ \t]*$", text, flags=re.M)
    assert len(parts) == 2, "README.md needs exactly one '## Quickstart' heading"
    section = re.split(r"^## ", parts[1], maxsplit=1, flags=re.M)[0]
    block = re.search(r"^```(\w*)\n(.*?)^```[ \t]*$", section, flags=re.M | re.S)
    assert block and block.group(1) == "bash", "the Quickstart section's first fenced block must be ```bash"
    commands = [shlex.split(line, comments=True) for line in block.group(2).splitlines()]
    return [argv for argv in commands if argv]


def headings(path: Path) -> list[str]:
    """Markdown headings of a file, code blocks skipped."""
    found, in_code = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """Relative links of a Markdown page whose file (or heading anchor) does not exist."""
    broken, in_code = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        for target in [] if in_code else LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not file.exists():
                broken.append(f"{where} (no file {file.relative_to(ROOT)})")
            elif anchor and file.suffix == ".md" and anchor not in {slug(h) for h in headings(file)}:
                broken.append(f"{where} (no heading with anchor #{anchor})")
    return broken


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; reference goes under docs/"


def test_readme_and_docs_links_resolve():
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    docs_links = [t for t in LINK.findall(README.read_text(encoding="utf-8")) if t.startswith("docs/")]
    assert docs_links, "README.md links to no docs/ page"
    broken = [b for page in pages for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_quickstart_block_is_found():
    commands = quickstart_commands(README.read_text(encoding="utf-8"))
    assert commands and all(argv[0] in ("llmopt", "kill") for argv in commands), commands


def readme_commands(text: str) -> list[list[str]]:
    """Every command README.md shows: each line of its ```bash blocks and each `llmopt ...` or `make ...` code
    span in its prose. A span that only names a command (`llmopt serve`) or has a placeholder
    (`llmopt COMMAND --help`, `--tp N`) is left out: it is not something to paste."""
    found, in_code, lang = [], False, ""
    for line in text.splitlines():
        if FENCE.match(line):
            in_code, lang = not in_code, line.strip().strip("`~")
            continue
        spans = [line] if in_code and lang == "bash" else [] if in_code else INLINE.findall(line)
        for span in spans:
            argv = shlex.split(span, comments=True)
            if argv and argv[-1] == "&":
                argv = argv[:-1]
            if argv and argv[0] in ("llmopt", "make") and len(argv) > 2 - (argv[0] == "make") \
                    and not any(PLACEHOLDER.fullmatch(a) for a in argv):
                found.append(argv)
    return found


def test_every_command_in_the_readme_parses():
    """What the quickstart test does not run still parses: llmopt accepts every command as written (nothing
    runs), and every `make` target exists in the Makefile."""
    from click.exceptions import Exit

    from tests.cli.paste import parse_command

    commands = readme_commands(README.read_text(encoding="utf-8"))
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), flags=re.M))
    assert ["make", "demo"] in commands and ["llmopt", "run", "smollm2-w4a16-gptq"] in commands, commands
    for argv in commands:
        if argv[0] == "make":
            assert set(argv[1:]) <= targets, f"`{shlex.join(argv)}`: no such target in the Makefile"
            continue
        try:
            parse_command(argv)
        except Exit as e:  # --help answers and exits 0
            assert e.exit_code == 0, shlex.join(argv)


def bash_block_commands(text: str) -> list[list[str]]:
    """The `llmopt ...` lines of a page's ```bash blocks (a trailing & dropped): what a reader pastes as is."""
    found, in_code, lang = [], False, ""
    for line in text.splitlines():
        if FENCE.match(line):
            in_code, lang = not in_code, line.strip().strip("`~")
        elif in_code and lang == "bash":
            argv = shlex.split(line, comments=True)
            argv = argv[:-1] if argv and argv[-1] == "&" else argv
            if argv and argv[0] == "llmopt":
                found.append(argv)
    return found


def test_every_command_in_a_docs_bash_block_parses():
    """The docs' ```bash blocks, e.g. the replicas-and-router walk-through that was the quickstart's tail (route.md),
    parse as written, as the README's commands do."""
    from tests.cli.paste import parse_command

    commands = {p.name: bash_block_commands(p.read_text(encoding="utf-8")) for p in (ROOT / "docs").rglob("*.md")}
    assert ["llmopt", "route", "--replica", "http://127.0.0.1:8000", "--replica", "http://127.0.0.1:8001",
            "--port", "8080"] in commands["route.md"], commands["route.md"]
    for argv in (argv for page in commands.values() for argv in page):
        parse_command(argv)


# --- running the quickstart -------------------------------------------------------------------------


def llmopt_argv(args: list[str]) -> list[str]:
    script = Path(sys.executable).with_name("llmopt")  # the installed console script, as a user runs it
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "llmopt.cli.main", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_ports(commands: list[list[str]]) -> list[list[str]]:
    """Each background server's README port (`--port N` on a line ending in &) replaced by a free one, there and in
    every URL that names it, so the test never collides with a port in use."""
    ports = {argv[argv.index("--port") + 1]: str(free_port()) for argv in commands
             if argv[-1] == "&" and "--port" in argv}
    out = []
    for argv in commands:
        argv = list(argv)
        for old, new in ports.items():
            argv = [re.sub(rf"^(https?://(?:127\.0\.0\.1|localhost)):{old}\b", rf"\g<1>:{new}", a) for a in argv]
        if argv[-1] == "&" and "--port" in argv:
            i = argv.index("--port") + 1
            argv[i] = ports[argv[i]]
        out.append(argv)
    return out


def server_port(argv: list[str]) -> int:
    assert "--port" in argv, f"`{shlex.join(argv)}`: a background server in the quickstart names its --port"
    return int(argv[argv.index("--port") + 1])


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def wait_healthy(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode} before /health was 200:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):  # 503 while loading, or the port not open yet
            pass
        time.sleep(0.5)
    pytest.fail(f"/health was not 200 within {HEALTH_TIMEOUT_S} s:\n{tail(log)}")


def stop(server: subprocess.Popen) -> int:
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        pytest.fail("the server did not exit within 60 s of SIGTERM")


def run_one(argv: list[str], cwd: Path, env: dict, log: Path) -> None:
    with open(log, "w") as out:
        rc = subprocess.run(llmopt_argv(argv[1:]), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            timeout=COMMAND_TIMEOUT_S).returncode
    assert rc == 0, f"`{shlex.join(argv)}` exited {rc}:\n{tail(log)}"


@pytest.mark.integration
def test_quickstart_runs(tmp_path):
    """Every line, in order, as a new user runs them: in an empty folder, with an empty import cache. A line ending
    in & starts background job %1, %2, ... (bash's numbering); `kill %1 %2` sends them SIGTERM and each must exit 0."""
    commands = with_ports(quickstart_commands(README.read_text(encoding="utf-8")))
    env = dict(os.environ, LLMOPT_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    work = tmp_path / "work"
    work.mkdir()
    jobs: dict[int, subprocess.Popen] = {}
    timings = []
    try:
        for i, argv in enumerate(commands):
            start, log = time.monotonic(), tmp_path / f"{i:02d}-{argv[0]}-{argv[1]}.log"
            if argv[0] == "kill":
                numbers = [int(a[1:]) for a in argv[1:] if re.fullmatch(r"%\d+", a)]
                assert numbers and len(numbers) == len(argv) - 1, f"`{shlex.join(argv)}`: kill takes %N job numbers"
                for n in numbers:
                    assert n in jobs, f"`{shlex.join(argv)}`: no background job %{n}"
                    code = stop(jobs.pop(n))
                    assert code == 0, f"job %{n} exited {code} after SIGTERM (drain should exit 0)"
            elif argv[0] != "llmopt":
                pytest.fail(f"quickstart line `{shlex.join(argv)}` is neither `llmopt ...` nor `kill %N`")
            elif argv[-1] == "&":
                n = max(jobs, default=0) + 1  # bash: one more than the highest job still in the table
                with open(log, "w") as out:  # the child keeps its own copy of the descriptor
                    jobs[n] = subprocess.Popen(llmopt_argv(argv[1:-1]), cwd=work, env=env, stdout=out,
                                               stderr=subprocess.STDOUT)
                wait_healthy(jobs[n], server_port(argv), log)
            else:
                run_one(argv, work, env, log)
            timings.append(f"{time.monotonic() - start:6.1f} s  {shlex.join(argv)}")
        assert not jobs, f"background jobs still running at the end of the quickstart: {sorted(jobs)}"
    finally:
        for job in jobs.values():
            stop(job)
        print("\n".join(timings))
