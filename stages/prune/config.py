"""PruneConfig: the typed, validated options of `llmopt prune`, with their defaults (the only ones)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from ..calib import CalibConfig
from ..errors import ConfigError
from ..options import FromOptions, Option, Options, dtype_option

METHODS = ("magnitude", "wanda", "sparsegpt")
STRUCTURED = ("mlp", "layers")
DEFAULT_SPARSITY = 0.5


def parse_pattern(pattern: str) -> tuple[int, int] | None:
    """'unstructured' -> None; 'N:M' -> (N, M) with 0 < N < M."""
    if pattern == "unstructured":
        return None
    try:
        n, m = (int(part) for part in pattern.split(":"))
    except ValueError:
        raise ConfigError(f"--pattern must be unstructured or N:M such as 2:4 (got {pattern})") from None
    if not 0 < n < m:
        raise ConfigError(f"--pattern {pattern}: N:M needs 0 < N < M")
    return n, m


@dataclass(frozen=True)
class PruneConfig(FromOptions):
    """One pruning: zeros (method, sparsity or N:M) or structured removal, calibration, the before/after check."""

    method: str | None = None  # magnitude | wanda | sparsegpt (default wanda); None with --structured
    sparsity: float | None = None  # None: 0.5, or what an N:M pattern implies
    pattern: str = "unstructured"
    structured: str | None = None  # mlp | layers
    ratio: float | None = None  # --structured mlp: share of intermediate channels to remove
    drop: int | None = None  # --structured layers: how many decoder layers to remove
    ignore: tuple[str, ...] = ()
    calib: CalibConfig = field(default_factory=CalibConfig)
    damp: float = 0.01
    device: str = "cpu"
    dtype: str = "auto"  # the weights' dtype while pruning (auto keeps the source's)
    batch_size: int = 8
    eval_windows: int = 4

    @classmethod
    def from_values(cls, o: dict) -> "PruneConfig":
        """The config for every option's value (see `OPTIONS`: the command line's names)."""
        return cls(method=o["method"], sparsity=o["sparsity"], pattern=o["pattern"], structured=o["structured"],
                   ratio=o["ratio"], drop=o["drop"], ignore=tuple(o["ignore"] or ()), calib=CalibConfig.from_values(o),
                   damp=o["damp"], device=o["device"], dtype=o["dtype"], eval_windows=o["eval_windows"])

    def validate(self) -> None:
        if self.structured is None:
            self._validate_unstructured()
        else:
            self._validate_structured()
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be cpu or cuda (got {self.device})")
        if not 0 < self.damp < 1:
            raise ConfigError(f"--damp must lie in (0, 1) (got {self.damp})")
        if self.eval_windows < 0 or self.batch_size < 1:
            raise ConfigError("--eval-windows must be >= 0 and the batch size >= 1")
        if self.needs_calibration:
            self.calib.validate()

    def _validate_unstructured(self) -> None:
        if self.method_name not in METHODS:
            raise ConfigError(f"unknown --method {self.method}; choose one of {', '.join(METHODS)}")
        if self.ratio is not None or self.drop is not None:
            raise ConfigError("--ratio and --drop go with --structured mlp / --structured layers")
        nm = parse_pattern(self.pattern)
        if self.sparsity is not None and not 0 <= self.sparsity < 1:
            raise ConfigError(f"--sparsity must lie in [0, 1) (got {self.sparsity})")
        if nm and self.sparsity is not None and abs(self.sparsity - self.target_sparsity) > 1e-9:
            raise ConfigError(f"--pattern {self.pattern} prunes {self.target_sparsity:g} of the weights; "
                              f"drop --sparsity {self.sparsity:g}")

    def _validate_structured(self) -> None:
        if self.structured not in STRUCTURED:
            raise ConfigError(f"unknown --structured {self.structured}; choose one of {', '.join(STRUCTURED)}")
        if self.method is not None or self.sparsity is not None or self.pattern != "unstructured" or self.ignore:
            raise ConfigError("--structured removes whole channels or layers; drop --method, --sparsity, "
                              "--pattern and --ignore")
        if self.structured == "mlp" and (self.ratio is None or not 0 < self.ratio < 1 or self.drop is not None):
            raise ConfigError(f"--structured mlp needs --ratio in (0, 1) and no --drop (got ratio {self.ratio})")
        if self.structured == "layers" and (self.drop is None or self.drop < 1 or self.ratio is not None):
            raise ConfigError(f"--structured layers needs --drop K >= 1 and no --ratio (got drop {self.drop})")

    @property
    def method_name(self) -> str:
        if self.structured:
            return f"structured-{self.structured}"
        return self.method or "wanda"

    @property
    def nm(self) -> tuple[int, int] | None:
        return None if self.structured else parse_pattern(self.pattern)

    @property
    def target_sparsity(self) -> float:
        """The share of each pruned weight that becomes zero."""
        nm = self.nm
        if nm:
            return (nm[1] - nm[0]) / nm[1]
        return DEFAULT_SPARSITY if self.sparsity is None else self.sparsity

    @property
    def needs_calibration(self) -> bool:
        return self.method_name != "magnitude"

    def to_dict(self) -> dict:
        """The manifest's record: what was done (the dtype is left out: the manifest's model.dtype says it)."""
        data = asdict(self)
        data.pop("dtype")
        data["ignore"] = list(self.ignore)
        data["method"] = self.method_name
        if self.structured is None:  # record what was done, not which options were left out
            data["sparsity"] = self.target_sparsity
            data.pop("ratio"), data.pop("drop")
        else:
            data.pop("sparsity"), data.pop("pattern"), data.pop("damp")
        if not self.needs_calibration:
            data.pop("calib")
        return data


DEFAULTS = PruneConfig()
OPTIONS = Options(
    Option("method", str, DEFAULTS.method, optional=True), Option("sparsity", float, DEFAULTS.sparsity, optional=True),
    Option("pattern", str, DEFAULTS.pattern), Option("structured", str, DEFAULTS.structured, optional=True),
    Option("ratio", float, DEFAULTS.ratio, optional=True), Option("drop", int, DEFAULTS.drop, optional=True),
    Option("ignore", list, None, optional=True), *CalibConfig.options(), Option("damp", float, DEFAULTS.damp),
    Option("device", str, DEFAULTS.device), dtype_option(DEFAULTS.dtype), Option("eval_windows", int, DEFAULTS.eval_windows),
)
PruneConfig.OPTIONS = OPTIONS
