"""QuantizeConfig: the typed, validated options of `llmopt quantize`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..calib import CalibConfig
from ..errors import ConfigError

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
EMBEDDINGS = ("keep", "int8")  # the input embedding: left as is, or RTN int8 group-wise (and a tied lm_head with it)


@dataclass(frozen=True)
class QuantizeConfig:
    method: str = "gptq"
    scheme: str = "W4A16"
    group_size: str = "auto"  # auto | 32 | 64 | 128 | -1 (per channel)
    symmetric: bool = True
    ignore: tuple[str, ...] = ()
    calib: CalibConfig = field(default_factory=CalibConfig)
    damp: float = 0.01
    act_order: bool = False
    sink_share: float = 0.03  # GPTQ, AWQ: share of the Hessian / search loss given to attention-sink tokens (0: plain mean)
    observer: str = "mse"  # GPTQ: how a group's range is chosen (mse | minmax), see rtn.compute_qparams
    smoothing_alpha: float = 0.5
    device: str = "cpu"
    batch_size: int = 8
    eval_windows: int = 8
    embeddings: str = "keep"

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown --method {self.method}; choose one of {', '.join(METHODS)}")
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown --scheme {self.scheme}; choose one of {', '.join(SCHEMES)}")
        if self.scheme not in METHODS[self.method]:
            raise ConfigError(f"--method {self.method} does not make {self.scheme}; it makes "
                              f"{', '.join(METHODS[self.method])}")
        if self.group_size != "auto":
            try:
                gs = int(self.group_size)
            except ValueError:
                raise ConfigError(f"--group-size must be auto, -1 or a positive integer (got {self.group_size})") from None
            if gs != -1 and (gs < 2 or gs & (gs - 1)):
                raise ConfigError(f"--group-size must be auto, -1 or a power of two >= 2 (got {gs})")
        if self.scheme == "W8A8" and self.group_size not in ("auto", "-1"):
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
        if self.embeddings not in EMBEDDINGS:
            raise ConfigError(f"unknown --embeddings {self.embeddings}; choose one of {', '.join(EMBEDDINGS)}")
        if self.embeddings != "keep" and self.method == "bnb":
            raise ConfigError(f"--embeddings {self.embeddings} does not go with --method bnb; use --embeddings keep "
                              f"(int8 embeddings need --method {', '.join(m for m in METHODS if m != 'bnb')})")
        if self.eval_windows < 0:
            raise ConfigError("--eval-windows must be >= 0")
        if self.method in NEEDS_CALIBRATION:
            self.calib.validate()

    @property
    def weight_bits(self) -> int:
        return SCHEMES[self.scheme][0]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["ignore"] = list(self.ignore)
        if self.method not in NEEDS_CALIBRATION:
            data.pop("calib")
        return data
