"""Options shared by several commands, as Annotated aliases, and how a command hands its options to a stage."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmopt.kernels import BACKENDS
from llmopt.stages.calib import CHAT_MIX
from llmopt.stages.options import DTYPES

DType = Enum("DType", {name: name for name in DTYPES}, type=str)  # the stages' --dtype choices
Backend = Enum("Backend", {name: name for name in BACKENDS}, type=str)  # the kernels' backends

Source = Annotated[str, typer.Argument(help="Model source: HF directory, .gguf file, llmopt artifact, or alias (smollm2-135m).")]
Output = Annotated[Path, typer.Option("--output", "-o", help="Directory to write the artifact to.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing artifact at the output path.")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
DTypeOpt = Annotated[DType, typer.Option("--dtype", help="Weight dtype (auto keeps the source's).")]
BackendOpt = Annotated[Backend, typer.Option("--backend", help="Kernels (auto: triton on CUDA; on CPU cpu-native "
                                             "where it builds, else cpu-torch; reference: the exact torch twins).")]
Seqlen = Annotated[int, typer.Option("--seqlen", min=2, help="Tokens per evaluation window.")]
Threads = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: the CPUs this process may "
                                               "use: its affinity, capped by a cgroup CPU quota).")]
MaxWindows = Annotated[Optional[int], typer.Option("--max-windows", min=1, help="Evaluate only the first N windows.")]

# Quantize and prune: calibration, what to leave alone, where to compute, and the quick before/after check.
Calib = Annotated[str, typer.Option("--calib", help=f"auto (a model with a chat template: {CHAT_MIX}; else "
                                    "wikitext2-valid) | wikitext2-valid | sharegpt | code | FILE | self | a mix "
                                    "NAME:WEIGHT,NAME:WEIGHT,...")]
NSamples = Annotated[int, typer.Option("--nsamples", min=1)]
CalibSeqlen = Annotated[int, typer.Option("--seqlen", min=2)]
Seed = Annotated[int, typer.Option("--seed")]
Ignore = Annotated[Optional[list[str]], typer.Option("--ignore", help="Linear names/globs/re: to keep dense.")]
Device = Annotated[str, typer.Option("--device", help="cpu | cuda")]
EvalWindows = Annotated[int, typer.Option("--eval-windows", min=0, help="Perplexity windows before/after, of each "
                                           "evaluation set: wikitext2, code, chat (0: off).")]

# Tensor-parallel serving across machines (torchrun's variables); a single node needs none of them.
NNodes = Annotated[int, typer.Option("--nnodes", min=1, help="Machines a sharded artifact's ranks span.")]
NodeRank = Annotated[int, typer.Option("--node-rank", min=0, help="This machine's index (0 serves HTTP; "
                                       "others only run their ranks).")]
MasterAddr = Annotated[str, typer.Option("--master-addr", help="Node 0's address for the rank rendezvous.")]
MasterPort = Annotated[Optional[int], typer.Option("--master-port", min=1, max=65535,
                                                   help="Rendezvous port (default: a free one, single node).")]
TensorParallelSize = Annotated[int, typer.Option("--tensor-parallel-size", "-tp", min=1, help="Ranks to serve "
                                               "on, the source split at load time as vllm serve -tp does (llmopt "
                                               "shard --tp N keeps the split for reuse).")]


Speculative = Annotated[Optional[str], typer.Option(
    "--speculative", help="Speculative decoding of greedy requests: ngram (prompt lookup) or draft:PATH (a smaller "
    "model with the same tokenizer).")]
NumSpeculativeTokens = Annotated[Optional[int], typer.Option(
    "--num-speculative-tokens", min=1, max=16, help="Draft tokens per verify step, at most (default 4).")]
SpeculativeJson = Annotated[Optional[str], typer.Option(
    "--speculative-config", help='vLLM\'s JSON form: {"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_min": 1, "prompt_lookup_max": 3} or {"method": "draft_model", "model": PATH}.')]


def stage_options(values: dict, schema) -> dict:
    """The command's values of a stage's options (`schema`, a stages.options.Options), as the stage takes
    them: every name the schema has, choices as their plain strings."""
    return {name: values[name].value if isinstance(values[name], Enum) else values[name] for name in schema}
