"""Errors of the testbed: one small hierarchy so that a CLI can print the message and exit 1.

Every error carries the context a user needs to act on it (the step that failed, the field
path, the device ...) in its message. Catch `TestbedError` at the CLI boundary only.
"""


class TestbedError(Exception):
    """Base class of every error the testbed raises on purpose."""

    __test__ = False  # the name starts with "Test": keep pytest from collecting it


class ConfigError(TestbedError):
    """An experiment or profile configuration is invalid (the message names the field path)."""


class ShapingError(TestbedError):
    """A link could not be shaped as asked (missing qdisc, kernel module, privilege ...)."""


class DeviceError(TestbedError):
    """A device (container or process) failed to start, run or stop."""


class ImageError(TestbedError):
    """The worker image (or its base or wheelhouse) could not be built."""


class StorageError(TestbedError):
    """A result file could not be written (a full disk, a read-only one); names the file."""
