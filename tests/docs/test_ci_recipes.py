"""The CI recipes in docs/ci/ stay runnable as llmopt changes: every `llmopt` command in their shell
scripts names a command that exists and only options that command has, and parses as the CLI takes it.
docs/ci.md quotes each file whole, so the page and the files cannot drift apart."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml

from llmopt.cli.main import build_app
from llmopt.recipes.spec import load_recipe
from tests.cli.paste import parse_command

DOCS = Path(__file__).resolve().parents[2] / "docs"
WORKFLOWS = [DOCS / "ci" / "github-actions.yml", DOCS / "ci" / "gitlab-ci.yml"]
SCRIPT_KEYS = ("run", "script", "before_script", "after_script")  # GitHub steps' run:, GitLab jobs' script:
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "then", "do", "else", "elif", "{", "}", "!"}
REDIRECTS = {">", ">>", "<", ">|", "&>", ">&"}
FD_DUP = re.compile(r"(?<!\S)\d*>&\d+(?!\S)")  # 2>&1, which shlex would split into '2', '>&', '1'


def shell_scripts(node) -> list[str]:
    """Every shell script in a parsed workflow: the strings (or lists of strings) under SCRIPT_KEYS."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in SCRIPT_KEYS and isinstance(value, (str, list)):
                found += [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]
            else:
                found += shell_scripts(value)
    elif isinstance(node, list):
        found += [s for item in node for s in shell_scripts(item)]
    return found


def llmopt_commands(script: str) -> list[list[str]]:
    """The argv of each `llmopt ...` simple command in a script: continuation lines joined, comments
    dropped, split at ; && || | & and `then`/`do`, redirections and their targets removed."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(FD_DUP.sub(" ", line), posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words, skip_next = [], False
        for token in [*lexer, ";"]:
            if token in SEPARATORS:
                if words and words[0] == "llmopt":
                    commands.append(words)
                words = []
            elif token in REDIRECTS:
                skip_next = True
            elif skip_next:
                skip_next = False
            else:
                words.append(token)
    return commands


def workflow_commands(path: Path) -> list[list[str]]:
    return [argv for script in shell_scripts(yaml.safe_load(path.read_text())) for argv in llmopt_commands(script)]


def unknown_options(argv: list[str]) -> list[str]:
    """What in argv is not llmopt's: a subcommand that does not exist, or a --flag its command lacks."""
    command, path, rest = typer.main.get_command(build_app()), ["llmopt"], argv[1:]
    while getattr(command, "commands", None) and rest and rest[0] in command.commands:
        command, path, rest = command.commands[rest[0]], [*path, rest[0]], rest[1:]
    if getattr(command, "commands", None) and rest and not rest[0].startswith("-"):
        return [f"{' '.join(path)}: no command {rest[0]}"]
    options = {name: param for param in command.params if param.param_type_name == "option"
               for name in (*param.opts, *param.secondary_opts)}
    wrong, takes_value = [], False
    for word in rest:
        if takes_value:  # the value of the option before, even one that looks like a flag ("--max-num-seqs 8")
            takes_value = False
        elif word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            if name not in options:
                wrong.append(f"{' '.join(path)}: no option {name}")
            takes_value = name in options and not options[name].is_flag and "=" not in word
    return wrong


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_llmopt_command_of_a_ci_recipe_exists_with_its_options(path):
    commands = workflow_commands(path)
    shown = {tuple(argv[1:3]) if argv[1] == "bench" and argv[2] == "compare" else (argv[1],) for argv in commands}
    assert shown == {("run",), ("serve",), ("bench",), ("bench", "compare")}, commands
    for argv in commands:
        assert unknown_options(argv) == [], shlex.join(argv)
        parse_command(argv)  # and the whole line parses: values of the right type, arguments in place
    gates = [argv for argv in commands if argv[1:3] == ["bench", "compare"]]
    assert any("--max-regression" in argv for argv in gates) and any("--min-ratio" in argv for argv in gates)


def test_the_extraction_sees_through_shell_syntax():
    script = ("if [ -f b.json ]; then\n  llmopt bench compare b.json n.json \\\n    --min-ratio x=3  # why\nfi\n"
              "llmopt serve m --port 8000 > log 2>&1 & SERVER=$!\nkill $SERVER && llmopt bench --serve-args '--a 8'")
    assert llmopt_commands(script) == [["llmopt", "bench", "compare", "b.json", "n.json", "--min-ratio", "x=3"],
                                       ["llmopt", "serve", "m", "--port", "8000"],
                                       ["llmopt", "bench", "--serve-args", "--a 8"]]


def test_a_wrong_flag_or_command_is_named():
    assert unknown_options(["llmopt", "bench", "compare", "a", "b", "--min-ratios", "x=3"]) == [
        "llmopt bench compare: no option --min-ratios"]
    assert unknown_options(["llmopt", "bench", "--serve-args", "--not-a-bench-flag", "--jsn", "r.json"]) == [
        "llmopt bench: no option --jsn"]
    assert unknown_options(["llmopt", "serv", "m"]) == ["llmopt: no command serv"]
    assert unknown_options(["llmopt", "bench", "comapre", "a", "b"]) == ["llmopt bench: no command comapre"]
    assert unknown_options(["llmopt", "run", "r.yaml", "-o", "out", "--dry-run"]) == []


def test_ci_md_quotes_each_recipe_whole_and_the_artifact_recipe_loads():
    page = (DOCS / "ci.md").read_text()
    for path in [*WORKFLOWS, DOCS / "ci" / "recipe.yaml"]:
        assert path.read_text() in page, f"docs/ci.md does not quote {path.name} as it is"
    recipe = load_recipe(DOCS / "ci" / "recipe.yaml")
    assert [stage.kind for stage in recipe.stages] == ["quantize"]
