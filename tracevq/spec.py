"""Exchange-method names and their validated parameters. Pure Python (no torch)."""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass

from tracevq.errors import ConfigError
from tracevq.method_table import METHODS, QUANTISED, MethodEntry
from tracevq.placement import PLACEMENTS, Placement, placements_of


@dataclass(frozen=True)
class MethodSpec:
    """A method and its parameters.

    Attributes:
        name: a method of the table (`tracevq.method_table.METHODS`).
        K: codebook size (astra, trace-*).
        level_k: codewords at the tree level used for encoding (trace-*); None = finest (K),
            "auto" = chosen per session from the link rate and the local FFN time.
        level_min_k: with level_k "auto", the coarsest level it may choose (codewords): a
            floor on accuracy, since the rule weighs only time; None = the coarsest level.
        segment: Prism's group size s.
        mean_bits: width of each transmitted Prism mean element (32 = fp32, 16 = fp16).
        packed: Astra indices packed at ceil(log2 K) bits instead of 16-bit words.
        buffers: Trace-b gathers precomputed K/V rows (True) or recomputes the chain (False).
        dedup: receivers attend once per distinct remote codeword, with log(count) on its
            logit (exact wherever remote K/V depend on the index alone: astra, trace-b,
            trace-nb where its placement makes them so); False attends over every remote token.
        placement: Trace's Table VI case (tracevq.placement): trace-nb "1 A.i" (default),
            "1 A.ii", "1 A.iii", "1 B"; trace-b "2 B" (default), "2 A". None = the default.
        remote_ffn: trace-nb's receiver runs the FFN of the previous block on its copy of each
            remote token before LN1 and the K/V projection (the project's first reading; with
            placement "1 B" it is the Trace-nb of before placements). False (default): the
            copy goes to LN1 as it is, so the receiver's work per remote token is Astra's.
        search_beam: the sender's codeword search (trace-*): None (default) is the exact
            nearest codeword; an integer B searches only the members of the B groups, of
            about sqrt(K_m) codewords each, whose centres lie nearest the row (tracevq.search,
            BeamSearch): cheaper, and it may return a near codeword that is not the nearest.
            B at or above the number of groups (32 at K = 1024) is the exact search.
    """

    name: str
    K: int = 1024
    level_k: int | str | None = None
    level_min_k: int | None = None
    segment: int = 10
    mean_bits: int = 32
    packed: bool = False
    buffers: bool = True
    dedup: bool = True
    placement: str | None = None
    remote_ffn: bool = False
    search_beam: int | None = None

    @property
    def entry(self) -> MethodEntry:
        """The method's entry in the table."""
        return METHODS[self.name]

    @property
    def uses_codebooks(self) -> bool:
        return self.entry.codebooks

    @property
    def is_trace(self) -> bool:
        return self.entry.trace

    @property
    def exchanges(self) -> bool:
        """False for a method that runs on one device and sends nothing."""
        return self.entry.exchanges

    @property
    def resolved_level_k(self) -> int:
        """Codewords at the encoding level; 'auto' and None count as the finest level."""
        return self.K if self.level_k in (None, "auto") else int(self.level_k)

    @property
    def resolved_placement(self) -> Placement | None:
        """Trace's Table VI case (the method's default when unset); None for other methods."""
        if not self.is_trace:
            return None
        return PLACEMENTS[self.placement or self.entry.default_placement]

    def params(self) -> dict[str, object]:
        """Only the parameters this method accepts, for records and handshakes."""
        return {
            key: value for key, value in asdict(self).items() if key in METHODS[self.name].accepts
        }


def method_spec(name: str, **params: object) -> MethodSpec:
    """Validate a method name and its parameters; errors name the offending field."""
    if name not in METHODS:
        hint = difflib.get_close_matches(name, METHODS, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"unknown method {name!r}{suggestion}; known: {', '.join(METHODS)}", "name"
        )
    accepted = METHODS[name].accepts
    for key in params:
        if key not in accepted:
            hint = difflib.get_close_matches(key, accepted, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            allowed = ", ".join(accepted) or "no parameters"
            raise ConfigError(
                f"method {name!r}: unknown parameter {key!r}{suggestion}; accepts {allowed}",
                field=key,
            )
    default = METHODS[name].default_placement
    if default is not None and params.get("placement") is None:
        params = {**params, "placement": default}
    spec = MethodSpec(name=name, **params)  # type: ignore[arg-type]
    _check(spec)
    return spec


def _check(spec: MethodSpec) -> None:
    where = f"method {spec.name!r}"
    if not isinstance(spec.K, int) or spec.K < 2 or spec.K > 2**16:
        raise ConfigError(f"{where}: K must be an integer in 2..65536, got {spec.K!r}", "K")
    if not isinstance(spec.segment, int) or spec.segment < 1:
        raise ConfigError(
            f"{where}: segment must be a positive integer, got {spec.segment!r}", "segment"
        )
    if spec.mean_bits not in (16, 32):
        raise ConfigError(
            f"{where}: mean_bits must be 16 or 32, got {spec.mean_bits!r}", "mean_bits"
        )
    _check_placement(spec)
    for flag in ("packed", "buffers", "dedup", "remote_ffn"):
        if not isinstance(getattr(spec, flag), bool):
            raise ConfigError(f"{where}: {flag} must be true or false", flag)
    beam = spec.search_beam
    if beam is not None and (isinstance(beam, bool) or not isinstance(beam, int) or beam < 1):
        raise ConfigError(
            f"{where}: search_beam must be a positive integer (groups searched per row) or "
            f"absent for the exact search, got {beam!r}",
            "search_beam",
        )
    level, floor = spec.level_k, spec.level_min_k
    if floor is not None:
        if level != "auto":
            raise ConfigError(
                f"{where}: level_min_k bounds level_k: auto from below; level_k is {level!r}",
                "level_min_k",
            )
        if isinstance(floor, bool) or not isinstance(floor, int) or not 2 <= floor <= spec.K:
            raise ConfigError(
                f"{where}: level_min_k must be an integer in 2..K={spec.K}, got {floor!r}",
                "level_min_k",
            )
    if level is None or level == "auto":
        return
    if isinstance(level, bool) or not isinstance(level, int) or not 2 <= level <= spec.K:
        raise ConfigError(
            f"{where}: level_k must be 'auto' or an integer in 2..K={spec.K}, got {level!r}",
            "level_k",
        )


def _check_placement(spec: MethodSpec) -> None:
    """A Table VI case of this method's VQ group, named as in the paper ("1 A.i")."""
    if spec.placement is None:
        return
    where = f"method {spec.name!r}"
    own = placements_of(spec.name)
    if not isinstance(spec.placement, str) or spec.placement not in PLACEMENTS:
        hint = difflib.get_close_matches(str(spec.placement), own, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"{where}: placement must be one of {', '.join(map(repr, own))} (the paper's "
            f"Table VI cases), got {spec.placement!r}{suggestion}",
            "placement",
        )
    other = PLACEMENTS[spec.placement].method
    if other != spec.name:
        raise ConfigError(
            f"{where}: placement {spec.placement!r} is a case of {other!r} (its VQ codes "
            f"{QUANTISED[METHODS[other].quantises]}); {spec.name} takes "
            f"{', '.join(map(repr, own))}",
            "placement",
        )
