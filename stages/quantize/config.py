"""QuantizeConfig: the typed, validated options of `llmopt quantize`, with their defaults (the only ones)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from ..calib import CalibConfig
from ..errors import ConfigError
from ..options import FromOptions, Option, Options, dtype_option

SCHEMES = {
    # scheme -> (weight bits, activation bits or None, family)
    "W4A16": (4, None, "int"),
    "W8A16": (8, None, "int"),
    "W8A8": (8, 8, "int"),
    "NF4": (4, None, "bnb"),
    "INT8": (8, None, "bnb"),
}
METHODS = {
    "rtn": ("W4A16", "W8A16", "W8A8"),
    "gptq": ("W4A16", "W8A16"),
    "awq": ("W4A16", "W8A16"),
    "smoothquant": ("W8A8",),
    "bnb": ("NF4", "INT8"),
}
NEEDS_CALIBRATION = ("gptq", "awq", "smoothquant")
AUTO = "auto"  # how the command line and recipes spell group_size None, and the embeddings' own choice
# The input embedding: left as is, RTN int8 group-wise (and a tied lm_head with it), or auto: int8 where the
# embedding is a large share of the model (embeddings.choose_embeddings decides, once the model is loaded).
EMBEDDINGS = ("keep", "int8", AUTO)


@dataclass(frozen=True)
class QuantizeConfig(FromOptions):
    """One quantization: method and scheme, grid, calibration, method settings, and the before/after check."""

    method: str = "gptq"
    scheme: str = "W4A16"
    group_size: int | None = None  # None: auto (128, 64 or 32, whichever divides); -1: one group per output channel
    symmetric: bool = True
    ignore: tuple[str, ...] = ()
    calib: CalibConfig = field(default_factory=CalibConfig)
    damp: float = 0.01
    act_order: bool = False
    sink_share: float = 0.03  # GPTQ, AWQ: share of the Hessian / search loss given to attention-sink tokens (0: plain mean)
    observer: str = "mse"  # GPTQ: how a group's range is chosen (mse | minmax), see rtn.compute_qparams
    smoothing_alpha: float = 0.5
    device: str = "cpu"
    dtype: str = "auto"  # the weights' dtype while quantizing (auto keeps the source's)
    batch_size: int = 8
    eval_windows: int = 4
    embeddings: str = AUTO  # the run's manifest records what auto chose (keep or int8)

    @classmethod
    def from_values(cls, o: dict) -> "QuantizeConfig":
        """The config for every option's value (see `OPTIONS`: the command line's names)."""
        return cls(method=o["method"], scheme=o["scheme"].upper(), group_size=parse_group_size(o["group_size"]),
                   symmetric=not o["asym"], ignore=tuple(o["ignore"] or ()), calib=CalibConfig.from_values(o),
                   damp=o["damp"], act_order=o["act_order"], sink_share=o["sink_share"], observer=o["observer"],
                   smoothing_alpha=o["alpha"], device=o["device"], dtype=o["dtype"],
                   eval_windows=o["eval_windows"], embeddings=o["embeddings"])

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown --method {self.method}; choose one of {', '.join(METHODS)}")
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown --scheme {self.scheme}; choose one of {', '.join(SCHEMES)}")
        if self.scheme not in METHODS[self.method]:
            raise ConfigError(f"--method {self.method} does not make {self.scheme}; it makes "
                              f"{', '.join(METHODS[self.method])}")
        check_group_size(self.group_size)
        if self.scheme == "W8A8" and self.group_size not in (None, -1):
            raise ConfigError("W8A8 uses per-channel weight scales; drop --group-size")
        if not self.symmetric and self.scheme == "W8A8":
            raise ConfigError("W8A8 is symmetric (int8 x int8 matmul); drop --asym")
        if not 0 < self.damp < 1:
            raise ConfigError(f"--damp must lie in (0, 1) (got {self.damp})")
        if self.observer not in ("minmax", "mse"):
            raise ConfigError(f"--observer must be minmax or mse (got {self.observer})")
        if not 0 <= self.sink_share < 1:
            raise ConfigError(f"--sink-share must lie in [0, 1) (got {self.sink_share})")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be cpu or cuda (got {self.device})")
        self._validate_embeddings()
        if self.eval_windows < 0:
            raise ConfigError("--eval-windows must be >= 0")
        if self.method in NEEDS_CALIBRATION:
            self.calib.validate()

    def _validate_embeddings(self) -> None:
        if self.embeddings not in EMBEDDINGS:
            raise ConfigError(f"unknown --embeddings {self.embeddings}; choose one of {', '.join(EMBEDDINGS)}")
        if self.embeddings == "int8" and self.method == "bnb":
            raise ConfigError(f"--embeddings {self.embeddings} does not go with --method bnb; use --embeddings keep "
                              f"(int8 embeddings need --method {', '.join(m for m in METHODS if m != 'bnb')})")

    @property
    def weight_bits(self) -> int:
        return SCHEMES[self.scheme][0]

    def to_dict(self) -> dict:
        """The manifest's record of the config (the dtype is left out: the manifest's model.dtype says it)."""
        data = asdict(self)
        data["ignore"] = list(self.ignore)
        data.pop("dtype")
        if self.method not in NEEDS_CALIBRATION:
            data.pop("calib")
        return data


def parse_group_size(text: str | int | None) -> int | None:
    """What --group-size says (auto, -1, 64; a recipe may give a number): None for auto, else the integer."""
    if text is None or text == AUTO:
        return None
    try:
        return int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"--group-size must be auto, -1 or a positive integer (got {text})") from None


def check_group_size(size: int | None) -> None:
    """The one check of a configured group size: None (auto), -1 (per channel) or a power of two >= 2."""
    if size is None or size == -1:
        return
    if isinstance(size, bool) or not isinstance(size, int) or size < 2 or size & (size - 1):
        raise ConfigError(f"--group-size must be auto, -1 or a power of two >= 2 (got {size})")


def group_size_text(size) -> str:
    """A group size as the command line spells it; also reads manifests written before group sizes were
    numbers ("auto", "64")."""
    return AUTO if size is None or size == AUTO else str(size)


DEFAULTS = QuantizeConfig()
OPTIONS = Options(
    Option("method", str, DEFAULTS.method), Option("scheme", str, DEFAULTS.scheme),
    Option("group_size", str, group_size_text(DEFAULTS.group_size)), Option("asym", bool, not DEFAULTS.symmetric),
    Option("ignore", list, None, optional=True), *CalibConfig.options(),
    Option("act_order", bool, DEFAULTS.act_order), Option("damp", float, DEFAULTS.damp),
    Option("sink_share", float, DEFAULTS.sink_share), Option("observer", str, DEFAULTS.observer),
    Option("alpha", float, DEFAULTS.smoothing_alpha), Option("device", str, DEFAULTS.device),
    dtype_option(DEFAULTS.dtype), Option("eval_windows", int, DEFAULTS.eval_windows),
    Option("embeddings", str, DEFAULTS.embeddings),
)
QuantizeConfig.OPTIONS = OPTIONS
