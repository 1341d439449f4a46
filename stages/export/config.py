"""The export stage's config: the file format, and what may be re-quantized when no GGUF type is exact."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import ConfigError
from ..options import FromOptions, Option, Options

FORMATS = ("gguf",)
# GGUF types a tensor without an exact counterpart may be re-quantized to (gguf.quants can write these).
REQUANTIZE_TYPES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "f16", "bf16", "f32")
AUTO = "auto"


@dataclass(frozen=True)
class ExportConfig(FromOptions):
    """How to write an artifact as a GGUF file."""

    format: str = "gguf"
    # None: a quantized tensor with no exact GGUF type is refused; a type: it is re-quantized to that type
    allow_requantize: str | None = None
    # llama.cpp's pre-tokenizer name (tokenizer.ggml.pre); None: the source GGUF's, else read off tokenizer.json
    tokenizer_pre: str | None = None

    @classmethod
    def from_values(cls, values: dict) -> "ExportConfig":
        """The config for every option's value (the options are the fields; `auto` is None)."""
        pre = values["tokenizer_pre"]
        return cls(format=values["format"], allow_requantize=values["allow_requantize"],
                   tokenizer_pre=None if pre in (None, AUTO) else pre)

    def validate(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"--format {self.format!r}: choose one of {', '.join(FORMATS)}")
        if self.allow_requantize is not None and self.allow_requantize not in REQUANTIZE_TYPES:
            raise ConfigError(f"--allow-requantize {self.allow_requantize!r}: choose one of "
                              f"{', '.join(REQUANTIZE_TYPES)}")
        if self.tokenizer_pre is not None and not self.tokenizer_pre.strip():
            raise ConfigError("--tokenizer-pre must name llama.cpp's pre-tokenizer (or be auto)")

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULTS = ExportConfig()
OPTIONS = Options(
    Option("format", str, DEFAULTS.format, choices=FORMATS),
    Option("allow_requantize", str, DEFAULTS.allow_requantize, optional=True, choices=REQUANTIZE_TYPES),
    Option("tokenizer_pre", str, AUTO),
)
ExportConfig.OPTIONS = OPTIONS
