"""What `llmopt profile` measures: the sweep (run.py), or one measurement that replaces it: the memory
soak (soak.py), one decode step's matmuls per weight scheme (matmuls.py), or the engine on a synthetic
model (synthetic.py). Each returns a JSON-able report; `tables` renders any of them."""
from __future__ import annotations

from ..errors import ConfigError
from ..progress import StageHooks
from .config import ProfileConfig
from .tables import TableData


def check_sources(sources: list[str], config: ProfileConfig) -> None:
    """The sources a measurement takes: none for --synthetic, exactly one for --soak and --kernels."""
    mode = config.mode
    if mode == "synthetic" and sources:
        raise ConfigError("--synthetic builds its own model: give no SOURCE")
    if mode in ("soak", "kernels") and len(sources) != 1:
        raise ConfigError(f"--{mode} measures one model: give one SOURCE (got {len(sources)})")
    if mode == "sweep" and not sources:
        raise ConfigError("Missing argument 'SOURCES...': give a model source (or --synthetic SHAPE)")
    if config.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")


def run_measurement(sources: list[str], config: ProfileConfig, hooks: StageHooks | None = None) -> dict:
    """The measurement `config.mode` names, other than the sweep, on `sources`."""
    from .machine import torch_threads

    config.validate()
    check_sources(sources, config)
    with torch_threads(config.threads):
        if config.mode == "soak":
            from .soak import run_soak

            return run_soak(sources[0], config, hooks)
        if config.mode == "kernels":
            from .matmuls import run_matmuls

            return run_matmuls(sources[0], config, hooks)
        from .synthetic import run_synthetic

        return run_synthetic(config, hooks)


def tables(report: dict) -> list[TableData]:
    """Any measurement's report as titled tables (the sweep's are in tables.py)."""
    tool = report["tool"]
    if tool.endswith("--soak"):
        from .soak import soak_tables

        return soak_tables(report)
    if tool.endswith("--kernels"):
        from .matmuls import matmul_tables

        return matmul_tables(report)
    from .synthetic import synthetic_tables

    return synthetic_tables(report)
