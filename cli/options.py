"""Options shared by several commands, as Annotated aliases."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer


class DType(str, Enum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


Source = Annotated[str, typer.Argument(help="Model source: HF directory, .gguf file, llmopt artifact, or alias (smollm2-135m).")]
Output = Annotated[Path, typer.Option("--output", "-o", help="Directory to write the artifact to.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing artifact at the output path.")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
DTypeOpt = Annotated[DType, typer.Option("--dtype", help="Weight dtype (auto keeps the source's).")]
Seqlen = Annotated[int, typer.Option("--seqlen", min=2, help="Tokens per evaluation window.")]
MaxWindows = Annotated[Optional[int], typer.Option("--max-windows", min=1, help="Evaluate only the first N windows.")]

# Tensor-parallel serving across machines (torchrun's variables); a single node needs none of them.
NNodes = Annotated[int, typer.Option("--nnodes", min=1, help="Machines a sharded artifact's ranks span.")]
NodeRank = Annotated[int, typer.Option("--node-rank", min=0, help="This machine's index (0 serves HTTP; "
                                       "others only run their ranks).")]
MasterAddr = Annotated[str, typer.Option("--master-addr", help="Node 0's address for the rank rendezvous.")]
MasterPort = Annotated[Optional[int], typer.Option("--master-port", min=1, max=65535,
                                                   help="Rendezvous port (default: a free one, single node).")]
