"""Exchange methods: `make_method` builds the one object both the simulation and the worker use."""

from __future__ import annotations

from tracevq.bundle import Bundle
from tracevq.errors import ConfigError
from tracevq.methods.base import Method, Receiver, Sender
from tracevq.methods.baselines import Astra, Prism, Voltage
from tracevq.methods.trace import TraceMethod, auto_level
from tracevq.models import VisionTransformer
from tracevq.spec import MethodSpec, method_spec

__all__ = ["Method", "Sender", "Receiver", "make_method", "auto_level", "TraceMethod"]


def make_method(
    name: str | MethodSpec,
    model: VisionTransformer,
    bundle: Bundle | None = None,
    **params: object,
) -> Method:
    """The method `name` bound to `model`; codebook methods need a bundle fitted for `model`."""
    spec = name if isinstance(name, MethodSpec) else method_spec(name, **params)
    if spec.name in ("single", "voltage"):
        return Voltage(spec, model)
    if spec.name == "prism":
        return Prism(spec, model)
    if bundle is None:
        raise ConfigError(f"method {spec.name!r} needs a bundle of codebooks (none given)")
    if bundle.K != spec.K:
        raise ConfigError(
            f"method {spec.name!r}: asks for K={spec.K} but the bundle's codebooks have "
            f"K={bundle.K}"
        )
    quantizers, trees = bundle.family(spec.name)
    if spec.name == "astra":
        return Astra(spec, model, quantizers)
    return TraceMethod(spec, model, quantizers, trees)
