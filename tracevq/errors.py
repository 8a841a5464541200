"""Errors raised by the method library; each carries the context a user needs."""


class TraceError(Exception):
    """Base class of every error the method library raises on purpose."""


class ConfigError(TraceError):
    """A model, method or bundle parameter is invalid; the message names the parameter.

    `field` is the parameter's name when one parameter is at fault, so that a caller can
    prefix its own path (e.g. `methods[2].K`).
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class CheckpointError(TraceError):
    """A checkpoint file does not match the model: names the missing, unexpected or bad keys."""


class InputShapeError(TraceError, ValueError):
    """An input tensor's shape or layout is not the model's: names both shapes."""


class ProtocolError(TraceError):
    """A message on the wire is malformed: wrong length, level, block counter or fingerprint."""
