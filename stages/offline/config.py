"""OfflineConfig: what `llmopt bench --offline` runs. The prompt and sampling options are the online
bench's (the same Option objects, so their defaults are defined once, in stages/bench/stage.py); the
rest are the offline run's own."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..bench.config import ENDPOINTS, BenchConfig
from ..bench.dataset import DatasetConfig
from ..bench.server import ENGINES, ServerSpec
from ..bench.stage import OPTIONS as BENCH_OPTIONS
from llmopt.kernels import BACKENDS

from ..errors import ConfigError
from ..options import DTYPES, FromOptions, Option, Options, dtype_option

BASELINES = ("hf", "none")
# The online bench's options that mean the same offline, in its order.
SHARED = ("engine", "endpoint", "dataset", "num_prompts", "input_len", "output_len", "disable_shuffle",
          "max_concurrency", "seed", "temperature", "ignore_eos")


@dataclass(frozen=True)
class OfflineConfig(FromOptions):
    """One offline run: the prompts, which engine runs the sources, the transformers baseline, and where."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    endpoint: str = BenchConfig.endpoint  # chat: prompts through the chat template, as /v1/chat/completions
    engine: str = ServerSpec.engine  # llmopt: LLMEngine; hf: transformers generate for every source
    max_concurrency: int | None = BenchConfig.max_concurrency  # running sequences; None: every prompt; 1: batch-1 decode
    temperature: float = BenchConfig.temperature
    ignore_eos: bool = BenchConfig.ignore_eos
    baseline: str = "hf"  # hf: transformers generate on the first source, same dtype; none
    hf_batch_size: int = 8  # transformers' static batches (left-padded; a batch waits for its longest sequence)
    dtype: str = "auto"  # both sides; auto keeps the checkpoint's
    device: str = "cpu"
    backend: str = "auto"  # the engine's kernels, as `llmopt serve --backend` picks them
    threads: int | None = None  # torch threads; None keeps torch's default
    repeats: int = 1  # runs per source, in rounds over the sources; the median is reported
    speculative: str | None = None  # the engine's speculative decoding (`llmopt serve --speculative`); None: off
    num_speculative_tokens: int | None = None

    @classmethod
    def from_values(cls, o: dict) -> "OfflineConfig":
        data = DatasetConfig(o["dataset"], o["num_prompts"], o["input_len"], o["output_len"], o["seed"],
                             shuffle=not o["disable_shuffle"])
        return cls(data, o["endpoint"], o["engine"], o["max_concurrency"], o["temperature"], o["ignore_eos"],
                   o["baseline"], o["hf_batch_size"], o["dtype"], o["device"], o["backend"], o["threads"],
                   o["repeats"], o["speculative"], o["num_speculative_tokens"])

    @property
    def batch1(self) -> bool:
        """Batch-1 decode (one request at a time) rather than throughput."""
        return self.max_concurrency == 1

    def validate(self) -> None:
        self.dataset.validate()
        choices = {"--endpoint": (self.endpoint, tuple(ENDPOINTS)), "--engine": (self.engine, ENGINES),
                   "--baseline": (self.baseline, BASELINES), "--dtype": (self.dtype, DTYPES),
                   "--backend": (self.backend, BACKENDS)}
        for flag, (value, known) in choices.items():
            if value not in known:
                raise ConfigError(f"{flag} {value}: use one of {', '.join(known)}")
        for flag, value in {"--hf-batch-size": self.hf_batch_size, "--repeats": self.repeats,
                            "--max-concurrency": self.max_concurrency, "--threads": self.threads}.items():
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be at least 1 (got {value})")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be cpu or cuda (got {self.device})")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (got {self.temperature})")
        self.speculative_config()

    def speculative_config(self):
        from ..serve.engine.config import speculative_config

        return speculative_config(self.speculative, self.num_speculative_tokens)

    def describe(self) -> dict:
        """The run's settings as the report stores them."""
        return self.dataset.describe() | {
            "endpoint": ENDPOINTS[self.endpoint], "engine": self.engine, "max_concurrency": self.max_concurrency,
            "mode": "batch-1 decode" if self.batch1 else "throughput", "temperature": self.temperature,
            "ignore_eos": self.ignore_eos or self.batch1, "baseline": self.baseline,
            "hf_batch_size": self.hf_batch_size, "dtype": self.dtype, "device": self.device, "backend": self.backend,
            "repeats": self.repeats, "speculative": self.speculative,
            "num_speculative_tokens": self.num_speculative_tokens}


DEFAULTS = OfflineConfig()
OPTIONS = Options(
    *(BENCH_OPTIONS[name] for name in SHARED),
    Option("baseline", str, DEFAULTS.baseline, choices=BASELINES), Option("hf_batch_size", int, DEFAULTS.hf_batch_size),
    dtype_option(DEFAULTS.dtype), Option("device", str, DEFAULTS.device),
    Option("backend", str, DEFAULTS.backend, choices=BACKENDS),
    Option("threads", int, DEFAULTS.threads, optional=True), Option("repeats", int, DEFAULTS.repeats),
    Option("speculative", str, DEFAULTS.speculative, optional=True),
    Option("num_speculative_tokens", int, DEFAULTS.num_speculative_tokens, optional=True),
)
OfflineConfig.OPTIONS = OPTIONS
