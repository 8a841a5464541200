"""Link profiles: every shipped YAML loads; bad files fail naming the file and the field."""

from pathlib import Path

import pytest

from testbed.errors import ConfigError
from testbed.experiment.profiles import PROFILES_DIR, LinkProfile, available_profiles, load_profile

SHIPPED = sorted(PROFILES_DIR.glob("*.yaml"))


def test_profiles_ship() -> None:
    assert {"ideal", "wifi", "lte"} <= set(available_profiles())


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_every_shipped_profile_loads(path: Path) -> None:
    profile = load_profile(path)
    assert profile.name == path.stem
    assert load_profile(path.stem) == profile  # by name as well as by path
    assert profile.description


def test_ideal_is_rate_only_and_the_others_need_netem() -> None:
    assert not load_profile("ideal").needs_netem
    for name in ("wifi", "lte"):
        profile = load_profile(name)
        assert profile.needs_netem
        assert profile.delay_ms > 0 and profile.jitter_ms > 0 and profile.loss_pct > 0
    assert load_profile("lte").delay_ms > load_profile("wifi").delay_ms


def test_defaults() -> None:
    profile = LinkProfile(name="x")
    assert (profile.rate_mbit, profile.burst_bytes) == (None, None)
    assert (profile.delay_ms, profile.jitter_ms, profile.loss_pct) == (0, 0, 0)
    assert profile.queue_latency_ms == 50
    assert not profile.needs_netem
    assert LinkProfile(name="x", loss_pct=0.01).needs_netem


def test_unknown_key_names_file_and_suggests(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("name: typo\nrate_mbit: 5\ndelay_msec: 10\n")
    with pytest.raises(ConfigError) as raised:
        load_profile(path)
    message = str(raised.value)
    assert str(path) in message
    assert "delay_msec: unknown key (did you mean 'delay_ms'?)" in message


def test_negative_delay_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "negative.yaml"
    path.write_text("name: negative\ndelay_ms: -3\n")
    with pytest.raises(ConfigError) as raised:
        load_profile(path)
    message = str(raised.value)
    assert str(path) in message
    assert "delay_ms: must lie in 0..60000, got -3" in message


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("loss_pct: 150\n", "loss_pct"),
        ("rate_mbit: 0\n", "rate_mbit"),
        ("burst_bytes: x\n", "burst_bytes"),
    ],
)
def test_out_of_range_fields(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"invalid link profile: {field}: "):
        load_profile(path)


def test_unknown_profile_name_lists_the_available_ones() -> None:
    with pytest.raises(ConfigError) as raised:
        load_profile("wfi")
    message = str(raised.value)
    assert "unknown link profile 'wfi'" in message
    assert "did you mean 'wifi'?" in message
    for name in available_profiles():
        assert name in message


def test_profile_directory_can_be_chosen(tmp_path: Path) -> None:
    (tmp_path / "slow.yaml").write_text("rate_mbit: 1\n")  # the name defaults to the stem
    assert available_profiles(tmp_path) == ["slow"]
    assert load_profile("slow", directory=tmp_path) == LinkProfile(name="slow", rate_mbit=1)


def test_not_a_mapping_and_bad_yaml(tmp_path: Path) -> None:
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_profile(listing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_profile(broken)
    with pytest.raises(ConfigError, match="not found"):
        load_profile(tmp_path / "missing.yaml")
