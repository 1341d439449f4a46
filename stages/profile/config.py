"""ProfileConfig: what `llmopt profile` measures, how long, and what the capacity planner assumes."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from llmopt.kernels import BACKENDS

from ..errors import ConfigError
from ..options import FromOptions, Option, Options
from ..serve.engine.config import EngineConfig

DEVICES = ("cpu", "cuda")
SYNTHETIC_SHAPES = {  # --synthetic: hidden, intermediate, heads, kv heads, head dim, vocab
    "llama3-8b": (4096, 14336, 32, 8, 128, 128256),
    "tiny": (256, 512, 8, 2, 32, 4096),
}
QUANTIZE_SCHEMES = ("w4a16", "w8a16")  # --synthetic --quantize: RTN of the random layers (stages/synthetic_model.py)
# --quick: about a minute for two sources on a 2-core CPU (the full sweep takes several).
QUICK = dict(prompt_lens=(128, 512), batch_sizes=(1, 4, 16), context_lens=(128, 1024), decode_context=256,
             repeats=2, decode_steps=6, profile_steps=3, copy_mib=128)
# What the other measurements take where an option is not given (the sweep's options that mean the same).
MODE_PRESETS = {
    "kernels": dict(batch_sizes=(1, 8, 32), repeats=7),  # one decode step's matmuls at these row counts
    # the engine on a synthetic model: batches of 512-token prompts, 64 new tokens each, bf16
    "synthetic": dict(batch_sizes=(1, 32), decode_context=512, decode_steps=64, dtype="bf16"),
}
# What --synthetic's other tasks take instead (on top of the synthetic preset).
TASK_PRESETS = {
    # matmuls at these row counts, fp16 as cuBLAS is usually compared; paged attention over this context
    "kernel_speed": dict(batch_sizes=(1, 16, 64), decode_context=2048, dtype="fp16"),
    "check_greedy": dict(decode_steps=32),  # new tokens per prompt
}


@dataclass(frozen=True)
class ProfileConfig(FromOptions):
    """One profiling run; every source gets the same sweep so their numbers compare."""

    prompt_lens: tuple[int, ...] = (128, 256, 512, 1024, 2048)  # prefill: one sequence of each length
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # decode: batch sweep at `decode_context`
    context_lens: tuple[int, ...] = (128, 512, 1024, 2048)  # decode: context sweep at batch 1
    decode_context: int = 512  # tokens already in the cache of every sequence in the batch sweep
    repeats: int = 3  # prefill timings per length (median)
    decode_steps: int = 16  # decode steps timed per point (median)
    profile_steps: int = 5  # steps under torch.profiler, and under forward hooks (decode: at least decode_steps)
    block_size: int = 16
    copy_mib: int = 256  # copy-benchmark buffer: far larger than the last-level cache
    device: str = "cpu"
    dtype: str | None = None  # None keeps the checkpoint's dtype; fp32 | bf16 | fp16
    backend: str = "auto"  # the kernels, as `llmopt serve --backend` picks them
    enforce_eager: bool = False  # --synthetic: no CUDA-graph decode (as `llmopt serve --enforce-eager`)
    threads: int | None = None  # torch threads; None keeps torch's default
    memory_budget: str | None = None  # planner: bytes ("8GiB") or a fraction of free memory; None: 0.9
    plan_context: int = 2048  # planner: tokens each sequence may hold (prompt + output)
    target_tpot_ms: float | None = None  # planner: latency target for the --max-num-seqs advice
    top_ops: int = 12
    # Instead of the sweep (at most one): the memory soak, the matmul benchmark, or a synthetic model.
    soak: int | None = None  # requests through one engine, every fifth aborted (soak.py)
    soak_in_flight: int = 32  # soak: requests running at once
    max_rss_growth_mib: float = 32.0  # soak: the RSS growth after the warm-up that fails it
    kernels: bool = False  # one decode step's matmuls per weight scheme on the source's shapes (matmuls.py)
    synthetic: str | None = None  # a model shape (synthetic.py): the engine on random weights, no files
    layers: int | None = None  # kernels and synthetic: decoder layers (kernels: the model's; synthetic: 4)
    quantize: str | None = None  # synthetic: RTN-quantize the random layers (w4a16 | w8a16) before the engine runs
    # --synthetic's other tasks, instead of the engine (at most one): the kernel speed table (kernel_speed.py),
    # greedy tokens against the CPU fp32 path (greedy.py), or the model written as an artifact to disk
    kernel_speed: bool = False
    check_greedy: bool = False
    save_model: str | None = None
    acceptance: str | None = None  # a folder of the GPU check's reports: its PASS/FAIL table (acceptance.py)
    memory: bool = False  # where a serving process's bytes go, per category (memory.py)
    # --memory: the KV cache as `llmopt serve` sizes it from these (serve.build.kv_cache_plan)
    max_model_len: int | None = EngineConfig.max_model_len
    max_num_seqs: int = EngineConfig.max_num_seqs
    kv_cache_memory: str | None = EngineConfig.kv_cache_memory

    @classmethod
    def from_values(cls, values: dict) -> "ProfileConfig":
        """The full sweep, or --quick's, or another measurement's preset, with the options that were given
        (not None) on top."""
        given = {k: parse_int_list(v, f"--{k.replace('_', '-')}") if k in INT_LISTS else v
                 for k, v in values.items() if k != "quick" and v is not None}
        presets = {**MODE_PRESETS.get(mode_of(values), {}), **TASK_PRESETS.get(task_of(values), {})}
        return cls(**{**(QUICK if values["quick"] else {}), **presets, **given})

    @property
    def mode(self) -> str:
        """What this run measures: sweep (the default), soak, kernels, synthetic or acceptance."""
        return mode_of({name: getattr(self, name) for name in MODES})

    @property
    def task(self) -> str:
        """What --synthetic does: engine (the default), kernel_speed, check_greedy or save_model."""
        return task_of({name: getattr(self, name) for name in TASKS})

    @classmethod
    def quick(cls, **overrides) -> "ProfileConfig":
        """The short sweep (`--quick`); explicit options still win."""
        return cls(**{**QUICK, **{k: v for k, v in overrides.items() if v is not None}})

    def with_options(self, **overrides) -> "ProfileConfig":
        """A copy with the options that were given (None means: keep)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def validate(self) -> None:
        for name in ("prompt_lens", "batch_sizes", "context_lens"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ConfigError(f"--{name.replace('_', '-')}: give positive whole numbers (got {values})")
        if 1 not in self.batch_sizes:
            raise ConfigError("--batch-sizes must include 1: the decode roofline is measured at batch 1")
        positive = dict(decode_context=self.decode_context, repeats=self.repeats, decode_steps=self.decode_steps,
                        profile_steps=self.profile_steps, block_size=self.block_size, copy_mib=self.copy_mib,
                        plan_context=self.plan_context, top_ops=self.top_ops)
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be cpu or cuda (got {self.device})")
        if self.dtype not in (None, "auto", "fp32", "bf16", "fp16"):
            raise ConfigError(f"--dtype must be auto, fp32, bf16 or fp16 (got {self.dtype})")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend}: choose one of {', '.join(BACKENDS)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be at least 1 (got {self.threads})")
        if self.target_tpot_ms is not None and not self.target_tpot_ms > 0:
            raise ConfigError(f"--target-tpot-ms must be positive (got {self.target_tpot_ms})")
        self._validate_mode()
        if self.memory_budget is not None:
            from ..serve.runner import parse_kv_cache_memory

            try:
                parse_kv_cache_memory(self.memory_budget)
            except ConfigError:
                raise ConfigError(f"--memory-budget {self.memory_budget!r}: give bytes (8GiB, 512MB) "
                                  "or a fraction of free memory like 0.9") from None

    def _validate_mode(self) -> None:
        chosen = [f"--{name}" for name in MODES if getattr(self, name)]
        if len(chosen) > 1:
            raise ConfigError(f"{' and '.join(chosen)}: give one of them (each replaces the sweep)")
        for name in ("soak", "soak_in_flight", "layers", "max_model_len", "max_num_seqs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if not self.max_rss_growth_mib > 0:
            raise ConfigError(f"--max-rss-growth-mib must be positive (got {self.max_rss_growth_mib})")
        if self.synthetic is not None and self.synthetic not in SYNTHETIC_SHAPES:
            raise ConfigError(f"--synthetic {self.synthetic}: choose one of {', '.join(SYNTHETIC_SHAPES)}")
        self._validate_task()

    def _validate_task(self) -> None:
        chosen = [flag_name(name) for name in TASKS if getattr(self, name)]
        if chosen and self.synthetic is None:
            raise ConfigError(f"{chosen[0]} works on a synthetic model: add --synthetic SHAPE")
        if len(chosen) > 1:
            raise ConfigError(f"{' and '.join(chosen)}: give one of them (each replaces the engine run)")
        if self.quantize is not None:
            if self.quantize not in QUANTIZE_SCHEMES:
                raise ConfigError(f"--quantize {self.quantize}: choose one of {', '.join(QUANTIZE_SCHEMES)}")
            if self.synthetic is None or chosen:
                raise ConfigError("--quantize applies to the engine run of --synthetic SHAPE only")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ProfileConfig":
        """The inverse of to_dict (lists back to tuples); unknown keys are rejected."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown profile option(s): {', '.join(sorted(unknown))}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


MODES = ("soak", "kernels", "synthetic", "acceptance", "memory")  # each replaces the sweep
TASKS = ("kernel_speed", "check_greedy", "save_model")  # each replaces --synthetic's engine run


def mode_of(values) -> str:
    """The first of MODES that `values` (a mapping of option values) turns on, else the sweep."""
    return next((name for name in MODES if values.get(name)), "sweep")


def task_of(values) -> str:
    """The first of TASKS that `values` turns on, else the engine run."""
    return next((name for name in TASKS if values.get(name)), "engine")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_int_list(text: str | None, option: str) -> tuple[int, ...] | None:
    """'128,512 2048' -> (128, 512, 2048); None stays None; ConfigError names the option otherwise."""
    if text is None:
        return None
    parts = text.replace(",", " ").split()
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError(f"{option} {text!r}: give positive whole numbers separated by commas, e.g. 1,4,16")
    return values


DEFAULTS = ProfileConfig()
INT_LISTS = ("prompt_lens", "batch_sizes", "context_lens")  # given as text: 128,512,2048
# None: not given, so the full sweep's value (the config's default) or --quick's applies.
OPTIONS = Options(
    Option("quick", bool, False), *(Option(name, str, None, optional=True) for name in INT_LISTS),
    *(Option(name, int, None, optional=True) for name in ("decode_context", "decode_steps", "repeats")),
    Option("device", str, DEFAULTS.device), Option("dtype", str, None, optional=True),
    Option("backend", str, DEFAULTS.backend, choices=BACKENDS), Option("enforce_eager", bool, DEFAULTS.enforce_eager),
    Option("threads", int, None, optional=True), Option("memory_budget", str, None, optional=True),
    Option("plan_context", int, None, optional=True), Option("target_tpot_ms", float, None, optional=True),
    Option("soak", int, DEFAULTS.soak, optional=True), Option("soak_in_flight", int, DEFAULTS.soak_in_flight),
    Option("max_rss_growth_mib", float, DEFAULTS.max_rss_growth_mib), Option("kernels", bool, DEFAULTS.kernels),
    Option("synthetic", str, DEFAULTS.synthetic, optional=True), Option("layers", int, DEFAULTS.layers, optional=True),
    Option("quantize", str, DEFAULTS.quantize, optional=True, choices=QUANTIZE_SCHEMES),
    Option("kernel_speed", bool, DEFAULTS.kernel_speed), Option("check_greedy", bool, DEFAULTS.check_greedy),
    Option("save_model", str, DEFAULTS.save_model, optional=True),
    Option("acceptance", str, DEFAULTS.acceptance, optional=True), Option("memory", bool, DEFAULTS.memory),
    Option("max_model_len", int, DEFAULTS.max_model_len, optional=True),
    Option("max_num_seqs", int, DEFAULTS.max_num_seqs),
    Option("kv_cache_memory", str, DEFAULTS.kv_cache_memory, optional=True),
)
ProfileConfig.OPTIONS = OPTIONS
