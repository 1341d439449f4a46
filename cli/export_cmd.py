"""llmopt export ARTIFACT --format gguf -o model.gguf: an artifact as one GGUF file for llama.cpp."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from llmopt.stages.export.config import OPTIONS, REQUANTIZE_TYPES

from .options import Json, Source, stage_options
from .ui import human_bytes, note, out, print_json

D = OPTIONS.defaults
Opt = typer.Option


def run(source: Source,
        output: Annotated[Path, Opt("--output", "-o", help="The .gguf file to write.")],
        format: Annotated[str, Opt("--format", help="gguf (llama.cpp's format; the only one so far)")] = D.format,
        allow_requantize: Annotated[Optional[str], Opt(
            "--allow-requantize", metavar="TYPE", help="Re-quantize the tensors no GGUF type holds exactly (groups "
            f"other than 32, asymmetric, W8A8, non-fp16 scales) to TYPE: {' | '.join(REQUANTIZE_TYPES)}. Without "
            "it they are refused. The output lists every re-quantized tensor.")] = D.allow_requantize,
        tokenizer_pre: Annotated[str, Opt("--tokenizer-pre", help="llama.cpp's pre-tokenizer name "
                                          "(tokenizer.ggml.pre); auto: the source GGUF's, else from tokenizer.json.")]
        = D.tokenizer_pre,
        force: Annotated[bool, Opt("--force", help="Replace an existing GGUF file at the output path.")] = False,
        json: Json = False) -> None:
    from llmopt.stages.export.config import ExportConfig
    from llmopt.stages.export.run import run_export
    from llmopt.stages.progress import StageHooks

    config = ExportConfig.from_options(stage_options(locals(), OPTIONS))
    result = run_export(source, output, config, force=force, hooks=StageHooks(status=note))
    if json:
        print_json(result.to_dict())
    else:
        render(result)


def render(r) -> None:
    table = Table(title=f"exported -> {r.path}", title_justify="left", show_header=False)
    for how, label in (("exact", "re-packed bit for bit"), ("requantized", "re-quantized"), ("dense", "as stored")):
        if how in r.counts():
            table.add_row(label, ", ".join(f"{n} {qtype}" for qtype, n in sorted(r.counts()[how].items())))
    table.add_row("file type", r.file_type)
    t = r.tokenizer
    table.add_row("tokenizer", f"{t['model']} ({t['pre']} pre-tokenizer, from {t['pre_from']}), "
                  f"{t['tokens']:,} tokens, {t['merges']:,} merges{', chat template' if t['chat_template'] else ''}")
    table.add_row("lineage", " -> ".join(e.get("stage", "?") for e in r.lineage) or "none (not an artifact)")
    table.add_row("size", human_bytes(r.bytes))
    table.add_row("time", f"{r.seconds:.1f} s")
    out.print(table)
    if r.requantized:
        _requantized(r.requantized)
    if t["pre_from"] == "a guess":
        out.print("[dim]tokenizer.ggml.pre is 'default': llama.cpp may split text differently from the tokenizer; "
                  "name the model's own with --tokenizer-pre[/dim]")


def _requantized(tensors) -> None:
    table = Table(title=f"re-quantized ({len(tensors)} tensors, not bit-exact)", title_justify="left")
    for col in ("tensor", "GGUF", "artifact", "written as", "how", "why"):
        table.add_column(col, overflow="fold")
    for t in tensors:
        table.add_row(t.name, t.gguf_name, t.stored, t.qtype, t.method, t.why)
    out.print(table)
