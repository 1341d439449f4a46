"""What `llmopt profile` measures: the sweep (run.py), or one measurement that replaces it: the memory
soak (soak.py), one decode step's matmuls per weight scheme (matmuls.py), the engine on a synthetic
model (synthetic.py) or, on the same synthetic shapes, the kernel speed table (kernel_speed.py) and the
greedy check (greedy.py); the GPU check's PASS/FAIL table (acceptance.py); where a serving process's
memory goes (memory.py); or, for a pipeline-parallel artifact instead of the sweep, its stages' time (pipeline.py). Each returns a JSON-able
report; `tables` renders any of them."""
from __future__ import annotations

from ..errors import ConfigError
from ..progress import StageHooks
from .config import ProfileConfig
from .pipeline import pipeline_artifact
from .tables import TableData


def check_sources(sources: list[str], config: ProfileConfig) -> None:
    """The sources a measurement takes: none for --synthetic and --acceptance, exactly one for --soak and
    --kernels."""
    mode = config.mode
    if mode in ("synthetic", "acceptance") and sources:
        why = "builds its own model" if mode == "synthetic" else "reads reports"
        raise ConfigError(f"--{mode} {why}: give no SOURCE")
    if mode in ("soak", "kernels", "memory") and len(sources) != 1:
        raise ConfigError(f"--{mode} measures one model: give one SOURCE (got {len(sources)})")
    if mode == "sweep" and not sources:
        raise ConfigError("Missing argument 'SOURCES...': give a model source (or --synthetic SHAPE)")
    if mode == "sweep" and len(sources) > 1 and any(map(pipeline_artifact, sources)):
        raise ConfigError("a pipeline-parallel artifact is profiled alone (its stages, not the sweep): give one SOURCE")
    if config.device.startswith("cuda") and mode != "acceptance":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")


def run_measurement(sources: list[str], config: ProfileConfig, hooks: StageHooks | None = None,
                    quantizer=None) -> dict:
    """The measurement `config.mode` names, other than the sweep, on `sources`. quantizer: what --quantize
    runs on the synthetic model's layers (`synthetic.Quantizer`; the command passes the quantize stage's)."""
    config.validate()
    check_sources(sources, config)
    if config.mode == "acceptance":  # reads JSON: no torch
        from .acceptance import run_acceptance

        return run_acceptance(config.acceptance)
    from .machine import torch_threads

    if config.task == "save_model":
        raise ConfigError("--save-model writes a model; the command does that (stages/synthetic_model.py)")
    if config.mode == "sweep" and pipeline_artifact(sources[0]) is not None:
        from .pipeline import run_pipeline

        return run_pipeline(sources[0], config, hooks)
    with torch_threads(config.threads):
        if config.mode == "soak":
            from .soak import run_soak

            return run_soak(sources[0], config, hooks)
        if config.mode == "memory":
            from .memory import run_memory

            return run_memory(sources[0], config, hooks)
        if config.mode == "kernels":
            from .matmuls import run_matmuls

            return run_matmuls(sources[0], config, hooks)
        if config.task == "kernel_speed":
            from .kernel_speed import run_kernel_speed

            return run_kernel_speed(config, hooks)
        if config.task == "check_greedy":
            from .greedy import run_greedy_check

            return run_greedy_check(config, hooks)
        from .synthetic import run_synthetic

        return run_synthetic(config, hooks, quantizer)


def tables(report: dict) -> list[TableData]:
    """Any measurement's report as titled tables (the sweep's are in tables.py)."""
    tool = report["tool"]
    if tool.endswith("(pipeline)"):
        from .pipeline import pipeline_tables

        return pipeline_tables(report)
    if tool.endswith("--soak"):
        from .soak import soak_tables

        return soak_tables(report)
    if tool.endswith("--memory"):
        from .memory import memory_tables

        return memory_tables(report)
    if tool.endswith("--kernels"):
        from .matmuls import matmul_tables

        return matmul_tables(report)
    if tool.endswith("--kernel-speed"):
        from .kernel_speed import kernel_speed_tables

        return kernel_speed_tables(report)
    if tool.endswith("--check-greedy"):
        from .greedy import greedy_tables

        return greedy_tables(report)
    if tool.endswith("--acceptance"):
        from .acceptance import acceptance_tables

        return acceptance_tables(report)
    from .synthetic import synthetic_tables

    return synthetic_tables(report)
