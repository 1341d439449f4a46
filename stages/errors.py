"""Errors a user can cause. The CLI prints their message on one line and exits 2."""


class LlmoptError(Exception):
    """Base class: the message says what is wrong and what to do about it."""


class SourceError(LlmoptError):
    """A model source cannot be resolved or loaded."""


class ArtifactError(LlmoptError):
    """An artifact is missing, malformed, tampered with or cannot be written."""


class ConfigError(LlmoptError):
    """An option or configuration value is out of range or inconsistent."""


class DataError(LlmoptError):
    """An evaluation or calibration data set is missing or unusable."""
