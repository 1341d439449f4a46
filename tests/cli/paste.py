"""A command line as a person pastes it, parsed as `llmopt` parses it (nothing runs): tests of the commands
the docs and `llmopt run --dry-run` print use it."""
from __future__ import annotations

import shlex

import typer

from llmopt.cli.main import build_app


def unparsed(ctx) -> list[str]:
    """What a group left for its subcommand (click keeps the subcommand's name apart from its arguments)."""
    return [*(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])), *ctx.args]


def parse_command(argv: list[str]):
    """The context of the command argv runs, parsed down through the groups; click's UsageError when the
    command, an option or an argument is wrong or missing, or something is left over."""
    assert argv[0] == "llmopt", argv
    command = typer.main.get_command(build_app(argv[1:]))
    ctx = command.make_context("llmopt", argv[1:])
    while hasattr(ctx.command, "resolve_command") and unparsed(ctx):  # a group: on to the command argv names
        name, sub, rest = ctx.command.resolve_command(ctx, unparsed(ctx))
        ctx = sub.make_context(name, rest, parent=ctx)
    assert not unparsed(ctx), f"{shlex.join(argv)}: left over {unparsed(ctx)}"
    return ctx
