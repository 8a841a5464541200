"""One device's share of a sequence-parallel inference, step by step.

The caller moves the messages: the in-process simulation hands them over directly, the
network worker sends them on sockets. Both drive a `DeviceRun` the same way, per block b:

    message = run.begin_block(b)             # to peers now (Voltage, Prism, Astra; Trace at b=0)
    run.project_local(b)                     # local Q/K/V while peers' messages travel
    message = run.attend(b, peer_messages)   # peers' messages for b in; Trace's for b + 1 out
    run.finish_block(b)                      # local FFN, while Trace's message travels

Where `run.exchanges_at(b)` is False (Trace's exact-embedding placements at b = 0) nobody
sends for b and `attend` takes no messages: each receiver embeds its peer's tokens itself.

A peer's message can be finite and still break the block: values too large for the model
(3e38 passes the finiteness check and overflows the receiver's LayerNorm). So the keys and
values made from each peer's message must be finite, and so must the block's own output
(attention and FFN, which large finite inputs can overflow too) before anything of it is
sent: an error names the peer whose keys and values are the largest, never this device's
other peers, which an honest third device would otherwise be led to blame.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tracevq.errors import ConfigError
from tracevq.method_table import METHODS, exact_methods
from tracevq.methods import Method
from tracevq.models import RemoteKV, RemoteRows
from tracevq.partition import partition_ranges


class DeviceRun:
    """Device `rank`'s state for one inference of a batch."""

    def __init__(
        self,
        method: Method,
        rank: int,
        devices: int,
        inputs: Tensor,
        peer_names: dict[int, str] | None = None,
        sizes: Sequence[int] | None = None,
    ):
        """`peer_names` name the peers in errors about their messages (default "device p");
        `sizes`, every device's tokens (tracevq.partition; default even)."""
        if not method.spec.exchanges and devices > 1:
            exact = " or ".join(repr(m) for m in exact_methods() if METHODS[m].exchanges)
            raise ConfigError(
                f"method {method.name!r} runs on one device, not {devices}: use {exact} for the "
                "exact sequence-parallel run (it sends and counts its payload)",
                "devices",
            )
        self.method, self.rank = method, rank
        self.model = method.model
        self.ranges = partition_ranges(self.model.config.tokens, devices, sizes)
        batch = inputs.shape[0]
        start, stop = self.ranges[rank]
        self.sender = method.sender(rank, stop - start, batch)
        self.receivers = {
            peer: method.receiver(peer, b - a, batch)
            for peer, (a, b) in enumerate(self.ranges)
            if peer != rank
        }
        for peer, receiver in self.receivers.items():
            receiver.peer_name = (peer_names or {}).get(peer)
            receiver.bind_inputs(inputs, *self.ranges[peer])
        self.x = self.model.embed(inputs, start, stop)  # (B, n, D)
        self.z: Tensor | None = None
        self.local: tuple[Tensor, Tensor, Tensor] | None = None  # this block's own Q, K, V
        self.unique_remote_keys: int | None = None  # last attend's distinct remote rows (dedup)
        self.keys_attended = 0  # last attend's keys per query, own and remote (its work)
        self._remote: dict[int, RemoteKV] = {}  # this block's peers' keys and values, by peer

    @property
    def peers(self) -> list[int]:
        return list(self.receivers)

    def exchanges_at(self, block: int) -> bool:
        """True when peers send messages for `block` (there are peers and the method sends)."""
        return bool(self.receivers) and self.method.exchanges_at(block)

    def begin_block(self, block: int) -> bytes | None:
        return self.sender.pre_block(block, self.x) if self.receivers else None

    def project_local(self, block: int) -> None:
        """The block's Q/K/V of the local tokens: needs nothing from peers."""
        layer = self.model.blocks[block]
        self.local = layer.attn.qkv_heads(layer.norm1(self.x))  # (B, H, n, d) each

    def attend(self, block: int, messages: dict[int, bytes]) -> bytes | None:
        """Attention of local queries over local and remote K/V; returns the post-attention
        message (for block + 1) if the method sends one."""
        if self.local is None:
            self.project_local(block)
        assert self.local is not None
        (q, k, v), self.local = self.local, None
        layer = self.model.blocks[block]
        expected = self.exchanges_at(block)
        received = [
            self.receivers[peer].remote_kv(block, messages[peer] if expected else None)
            for peer in self.peers
        ]
        self._remote = {
            peer: r for peer, r in zip(self.peers, received, strict=True) if isinstance(r, RemoteKV)
        }
        for peer, remote in self._remote.items():
            if not (torch.isfinite(remote.k).all() and torch.isfinite(remote.v).all()):
                raise self._refuse(block, peer, "its keys and values are not finite")
        remotes = [r for r in received if isinstance(r, RemoteKV)]
        rows = [r for r in received if isinstance(r, RemoteRows)]
        self.unique_remote_keys = None
        if rows:
            remotes.append(self._unique_kv(block, rows))
        keys = torch.cat([k, *(r.k for r in remotes)], dim=2)  # (B, H, n_keys, d)
        self.keys_attended = keys.shape[2]
        values = torch.cat([v, *(r.v for r in remotes)], dim=2)
        bias = None
        if any(r.bias is not None for r in remotes):  # log(count) per mean key or unique row
            batch = q.shape[0]
            parts = [torch.zeros(batch, k.shape[2])]
            parts += [
                torch.zeros(batch, r.k.shape[2]) if r.bias is None else r.bias.expand(batch, -1)
                for r in remotes
            ]
            bias = torch.cat(parts, dim=1)  # (B, n_keys)
        self.z = self.x + layer.attn.attend(q, keys, values, bias)
        self._check_output(block, self.z, "attention")
        return self.sender.post_attention(block, self.x, self.z) if self.receivers else None

    def _check_output(self, block: int, output: Tensor, part: str) -> None:
        """A block's own output is finite, or the peer whose keys and values are the largest
        is named (without peers' keys and values to blame, the output is left as it is)."""
        if not self._remote or bool(torch.isfinite(output).all()):
            return

        def largest(peer: int) -> float:
            remote = self._remote[peer]
            return max(float(remote.k.abs().max()), float(remote.v.abs().max()))

        peer = max(self._remote, key=largest)
        raise self._refuse(block, peer, f"block {block}'s {part} overflows (values not finite)")

    def _refuse(self, block: int, peer: int, problem: str) -> Exception:
        return self.receivers[peer].refuse(f"{self.method.name} message", block, problem)

    def _unique_kv(self, block: int, remotes: list[RemoteRows]) -> RemoteKV:
        """One key per distinct row of all peers (the union over the batch), log(count) on its
        logit; -inf where a batch element has none of that row. Softmax over n equal rows
        equals softmax over one of them with log(n) added, so the output is unchanged.

        When the batch's union has at least as many rows as one input has remote tokens (large
        batches, fine levels), each input attends over its own tokens' rows instead, with no
        bias: the same output, and never more keys than without dedup."""
        rows = torch.cat([r.rows for r in remotes], dim=1)  # (B, n_remote)
        unique, inverse = torch.unique(rows, return_inverse=True)  # (U,), (B, n_remote)
        batch, distinct = rows.shape[0], unique.shape[0]
        if distinct >= rows.shape[1]:
            k, v = self.method.row_kv(block, rows.reshape(-1))  # (1, H, B * n_remote, d)
            self.unique_remote_keys = rows.shape[1]

            def per_input(t: Tensor) -> Tensor:
                return t[0].unflatten(1, rows.shape).transpose(0, 1)  # (B, H, n_remote, d)

            return RemoteKV(per_input(k), per_input(v), None)
        offsets = torch.arange(batch).unsqueeze(1) * distinct  # (B, 1)
        counts = torch.bincount((inverse + offsets).reshape(-1), minlength=batch * distinct)
        k, v = self.method.row_kv(block, unique)  # (1, H, U, d) each
        self.unique_remote_keys = distinct
        bias = counts.view(batch, distinct).to(k.dtype).log()  # (B, U)
        return RemoteKV(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), bias)

    def finish_block(self, block: int) -> None:
        assert self.z is not None, "finish_block before attend"
        self.x = self.model.blocks[block].ffn(self.z)
        self.z = None
        self._check_output(block, self.x, "FFN")
        self._remote = {}

    def logits(self) -> Tensor:
        """Class logits; only device 0 holds the CLS token."""
        assert self.rank == 0, "only device 0 holds the CLS token"
        return self.model.classify(self.x[:, 0])
