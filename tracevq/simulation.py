"""P devices in one process, exchanging the exact bytes the network worker would send."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tracevq.bundle import Bundle
from tracevq.engine import DeviceRun
from tracevq.errors import ConfigError
from tracevq.methods import Method, make_method
from tracevq.models import VisionTransformer
from tracevq.partition import device_layout


@dataclass
class SimulationResult:
    logits: Tensor  # (B, classes), from device 0
    payload_bits: np.ndarray  # (L, P): analytic bits each device sent for each block
    wire_bytes: np.ndarray  # (L, P): bytes of the messages each device sent for each block

    @property
    def payload_bits_per_layer(self) -> np.ndarray:
        """(P,) bits one device sends for one layer (the paper's Table II quantity)."""
        return self.payload_bits.max(axis=0)


@torch.no_grad()
def simulate(
    model: VisionTransformer,
    inputs: Tensor,
    method: str | Method = "voltage",
    devices: int | Sequence[int] = 2,
    bundle: Bundle | None = None,
    levels: Sequence[int] | None = None,
    **method_params: object,
) -> SimulationResult:
    """Run `method` on `devices` simulated devices; the messages are the real wire bytes.

    One device runs the same engine with no peers: nothing is sent. `single` is refused at
    more than one device (tracevq.engine.DeviceRun). `levels`: per device, the tree level a
    Trace method encodes its messages at (devices of a session that chose differently; each
    receiver decodes at the level in the message's header). `devices`: how many, split
    evenly, or every device's tokens (tracevq.partition)."""
    devices, sizes = device_layout(devices)
    if not isinstance(method, Method):
        method = make_method(method, model, bundle, **method_params)
    if levels is not None and (len(levels) != devices or not method.spec.is_trace):
        raise ConfigError(f"levels {list(levels)}: one per device, for a Trace method", "levels")

    own_level = method.level if method.spec.is_trace else None

    def at_level(rank: int) -> None:
        if levels is not None:
            method.set_level(levels[rank])

    depth = model.config.depth
    payload = np.zeros((depth, devices), dtype=np.int64)
    wire = np.zeros((depth, devices), dtype=np.int64)
    runs = [DeviceRun(method, rank, devices, inputs, sizes=sizes) for rank in range(devices)]
    inbox: dict[int, dict[int, bytes]] = defaultdict(dict)  # block -> sender -> message

    def post(block: int, rank: int, message: bytes | None) -> None:
        if message is None:
            return
        inbox[block][rank] = message
        tokens = runs[rank].ranges[rank][1] - runs[rank].ranges[rank][0]
        payload[block, rank] = method.payload_bits(tokens, inputs.shape[0])
        wire[block, rank] = len(message)

    for block in range(depth):
        for run in runs:
            at_level(run.rank)
            post(block, run.rank, run.begin_block(block))
            run.project_local(block)
        for run in runs:
            expected = run.exchanges_at(block)
            messages = {peer: inbox[block][peer] for peer in run.peers if expected}
            at_level(run.rank)
            post(block + 1, run.rank, run.attend(block, messages))
        for run in runs:
            run.finish_block(block)
        inbox.pop(block, None)
    if own_level is not None:
        method.set_level(own_level)  # as the caller gave it
    return SimulationResult(runs[0].logits(), payload, wire)
