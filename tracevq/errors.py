"""Errors raised by the method library; each carries the context a user needs."""


class TraceError(Exception):
    """Base class of every error the method library raises on purpose."""


class ConfigError(TraceError):
    """A model, method or bundle parameter is invalid; the message names the parameter."""


class CheckpointError(TraceError):
    """A checkpoint file does not match the model: names the missing, unexpected or bad keys."""


class ProtocolError(TraceError):
    """A message on the wire is malformed: wrong length, level, block counter or fingerprint."""
