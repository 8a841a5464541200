"""Exchange methods: `make_method` builds the one object both the simulation and the worker use,
from the method table (`tracevq.method_table`)."""

from __future__ import annotations

from tracevq.bundle import Bundle
from tracevq.errors import ConfigError
from tracevq.method_table import METHODS
from tracevq.methods.base import Codec, Method, Receiver, ReceiverView, Sender
from tracevq.methods.trace import TraceB, TraceMethod, TraceNB, auto_level
from tracevq.models import VisionTransformer
from tracevq.spec import MethodSpec, method_spec

__all__ = [
    "Method",
    "Sender",
    "Receiver",
    "ReceiverView",
    "Codec",
    "make_method",
    "auto_level",
    "TraceMethod",
    "TraceB",
    "TraceNB",
]


def make_method(
    name: str | MethodSpec,
    model: VisionTransformer,
    bundle: Bundle | None = None,
    **params: object,
) -> Method:
    """The method `name` bound to `model`; codebook methods need a bundle fitted for `model`."""
    spec = name if isinstance(name, MethodSpec) else method_spec(name, **params)
    entry = METHODS[spec.name]
    implementation = entry.implementation_class()
    if not entry.codebooks:
        return implementation(spec, model)
    if bundle is None:
        raise ConfigError(f"method {spec.name!r} needs a bundle of codebooks (none given)")
    if bundle.K != spec.K:
        raise ConfigError(
            f"method {spec.name!r}: asks for K={spec.K} but the bundle's codebooks have "
            f"K={bundle.K}"
        )
    return implementation(spec, model, *bundle.family(spec.name))
