"""A stage's options as the command line and recipes give them.

Each stage lists its options once (`Options`): the name (the command's parameter, with underscores),
the type, and the default, read from the stage's own config defaults so it is never restated. The
command line declares the same options with these defaults, recipes check what they are given against
them, and the stage's `Config.from_options` turns a mapping of them into its validated config. Options
that are no part of what a stage computes (output path, --force, --json, display) are not here.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar, Iterator, Mapping

from .errors import ConfigError


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # the default of an option the stage cannot do without
KINDS = (bool, int, float, str, list)  # list: a list of strings (a repeatable option)


class OptionError(ConfigError):
    """A value that does not fit its option (or an option the stage does not have)."""

    def __init__(self, name: str, problem: str):
        self.name, self.problem = name, problem
        super().__init__(f"{flag(name)}: {problem}")


def flag(name: str) -> str:
    """The command-line spelling of an option name: group_size -> --group-size."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Option:
    """One option: its name, type (bool | int | float | str | list of str) and default."""

    name: str
    kind: type
    default: object = REQUIRED
    optional: bool = False  # None is a value (not given, or "auto")
    choices: tuple[str, ...] = ()  # the only strings it takes, when it is a choice

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TypeError(f"option {self.name}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def required(self) -> bool:
        """Whether the stage cannot do without it (it has no default)."""
        return self.default is REQUIRED

    def check(self, value):
        """`value` as the option holds it (a whole number given for a float becomes a float, a tuple
        of strings a list); OptionError says what it expected."""
        if value is None:
            if self.optional:
                return None
            raise OptionError(self.name, "needs a value")
        if self.choices:
            if value not in self.choices:
                raise OptionError(self.name, f"expected one of {', '.join(self.choices)} (got {value!r})")
            return value
        checked = _CHECKS[self.kind](value)
        if checked is _WRONG:
            raise OptionError(self.name, f"expected {_EXPECTED[self.kind]} (got {value!r})")
        return checked


_WRONG = object()


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_CHECKS = {
    bool: lambda v: v if isinstance(v, bool) else _WRONG,
    int: lambda v: v if isinstance(v, int) and not isinstance(v, bool) else _WRONG,
    float: lambda v: float(v) if _number(v) else _WRONG,
    str: lambda v: v if isinstance(v, str) else _WRONG,
    list: lambda v: list(v) if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v) else _WRONG,
}
_EXPECTED = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
             list: "a string or a list of strings"}


class Options:
    """The options of one stage, in the command's order."""

    def __init__(self, *options: Option):
        self._options = {o.name: o for o in options}
        # Attribute access for the command line's signatures: `nsamples: ... = DEFAULTS.nsamples`.
        self.defaults = SimpleNamespace(**{o.name: o.default for o in options})

    def __iter__(self) -> Iterator[str]:
        return iter(self._options)

    def __contains__(self, name: object) -> bool:
        return name in self._options

    def __getitem__(self, name: str) -> Option:
        return self._options[name]

    def __len__(self) -> int:
        return len(self._options)

    def values(self) -> list[Option]:
        """The options, in the command's order."""
        return list(self._options.values())

    def complete(self, given: Mapping[str, object]) -> dict:
        """Every option's value: those given (type-checked), the defaults for the rest. Unknown names
        and missing required options raise ConfigError naming them."""
        unknown = [k for k in given if k not in self._options]
        if unknown:
            raise OptionError(unknown[0], f"no such option (known: {', '.join(flag(n)[2:] for n in self)})")
        values = {name: (o.check(given[name]) if name in given else o.default) for name, o in self._options.items()}
        missing = [flag(n) for n, v in values.items() if v is REQUIRED]
        if missing:
            raise ConfigError(f"{', '.join(missing)} is required")
        return values


class FromOptions:
    """What makes a stage's config buildable from its options: the config class sets `OPTIONS` (once its
    defaults exist) and turns the completed values into itself (`from_values`); it has `validate()`."""

    OPTIONS: ClassVar[Options]

    @classmethod
    def options(cls) -> Options:
        """The options the stage's command and a recipe's stage of this kind take."""
        return cls.OPTIONS

    @classmethod
    def from_options(cls, options: Mapping[str, object]):
        """The validated config for these options (names as the command's parameters; defaults for the rest)."""
        config = cls.from_values(cls.OPTIONS.complete(options))
        config.validate()
        return config


DTYPES = ("auto", "fp32", "bf16", "fp16")  # --dtype: auto keeps the checkpoint's


def dtype_option(default: str) -> Option:
    """The --dtype option of the stages that load a model."""
    return Option("dtype", str, default, choices=DTYPES)
