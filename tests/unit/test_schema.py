import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import testbed.backends.table  # noqa: F401 - as testbed.run does: the backends' sections register
from testbed.errors import ConfigError
from testbed.experiment.netem_parameters import ImpairmentError
from testbed.experiment.profiles import load_profile, parse_profile
from testbed.experiment.schema import load_experiment, parse_experiment
from testbed.sweep.plan import (
    device_profiles,
    impairment_label,
    link_profile,
    plan_rows,
    plan_trials,
)
from testbed.sweep.sessions import session_id

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {"name": "x", "methods": [{"name": "voltage"}]}


def with_(**changes):
    return {**MINIMAL, **changes}


@pytest.mark.parametrize(
    "path", sorted((ROOT / "experiments").rglob("*.yaml")), ids=lambda p: p.name
)
def test_every_experiment_file_loads_and_plans(path):
    experiment = load_experiment(path)
    # a device given as a rate (sweep-paper's paper-device) is planned with a host rate
    rows = plan_rows(experiment, plan_trials(experiment), host_gflops=80.0)
    assert rows and all(row.payload_bits_per_layer >= 0 for row in rows)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (with_(devices={"cout": 2}), "e.yaml: devices.cout: unknown key (did you mean 'count'?)"),
        (with_(modle={}), "modle: unknown key (did you mean 'model'?)"),
        (
            with_(methods=[{"name": "voltage"}, {"name": "trace-b", "K": "a"}]),
            "methods[1].K: method 'trace-b': K must be an integer",
        ),
        (
            with_(methods=[{"name": "astra", "segment": 3}]),
            "methods[0].segment: method 'astra': unknown parameter 'segment'",
        ),
        (
            with_(methods=[{"name": "voltge"}]),
            "methods[0].name: unknown method 'voltge' (did you mean 'voltage'?)",
        ),
        (with_(methods=[{"K": 3}]), "methods[0]: needs a 'name'"),
        (
            with_(link={"bandwidth_mbit": [10, 0]}),
            "link.bandwidth_mbit: every bandwidth must be positive",
        ),
        (
            with_(model={"name": "vit-b17"}),
            "model.name: unknown model 'vit-b17' (did you mean 'vit-b16'?)",
        ),
        ({"methods": [{"name": "voltage"}]}, "name: Field required"),
        (
            with_(methods=[{"name": "trace-b", "level_k": [1024, 4096]}]),
            "methods[0].level_k: method 'trace-b': level_k must be 'auto' or an integer",
        ),
    ],
)
def test_bad_experiments_name_the_field_and_file(data, message):
    with pytest.raises(ConfigError) as caught:
        parse_experiment(data, "e.yaml")
    assert message in str(caught.value)
    assert str(caught.value).startswith("e.yaml: ")


def test_lists_expand_into_a_grid_in_run_order():
    experiment = parse_experiment(
        with_(
            devices={"count": [2, 3]},
            link={"bandwidth_mbit": [1, 10]},
            methods=[{"name": "trace-b", "K": 1024, "level_k": [1024, 2]}, {"name": "voltage"}],
        )
    )
    trials = plan_trials(experiment)
    assert len(trials) == 2 * 2 * 3
    assert [t.devices for t in trials] == [2] * 6 + [3] * 6
    assert [t.bandwidth_mbit for t in trials[:6]] == [1] * 3 + [10] * 3
    assert trials[0].trial_id == "p2-trace-b-K1024-levelk1024-1mbit"
    assert len({t.trial_id for t in trials}) == len(trials)


def test_plan_rows_carry_the_papers_arithmetic():
    experiment = parse_experiment(
        with_(
            model={"name": "vit-b16"},
            methods=[{"name": "trace-b", "K": 1024}, {"name": "voltage"}],
        )
    )
    rows = {(r.method, r.rank): r for r in plan_rows(experiment, plan_trials(experiment))}
    trace = rows[("trace-b", 0)]
    assert trace.payload_bits_per_layer == 998 and trace.r_bits == 10
    assert trace.analytic_comm_ms_paper == pytest.approx(1.14, abs=0.005)  # Table IV
    assert rows[("voltage", 0)].analytic_comm_ms == pytest.approx(32 * 99 * 768 * 12 / 1e4)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="experiment file not found"):
        load_experiment(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_experiment(bad)


def test_planning_does_not_import_torch():
    code = (
        "import sys; from testbed.experiment.schema import parse_experiment;"
        "from testbed.sweep.plan import *;"
        "e = parse_experiment({'name': 'x', 'methods': [{'name': 'trace-b'}]});"
        "plan_rows(e, plan_trials(e)); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_link_emulator_defaults_to_the_backends_and_serial_is_refused_on_ssh_boards():
    from testbed.backends.table import BACKENDS
    from testbed.experiment.profiles import load_profile
    from testbed.link.emulators import emulator_class

    docker, local, ssh = (BACKENDS[name] for name in ("docker", "local", "ssh"))
    assert emulator_class(None, docker).name == emulator_class(None, local).name == "serial"
    assert emulator_class(None, ssh).name == emulator_class("tbf", local).name == "tbf"
    refused = emulator_class("serial", ssh).refusal(load_profile("ideal"), ssh, False)
    assert refused is not None and refused.field == "link.emulator"
    assert refused.why.startswith("serial needs the devices on this host")
    with pytest.raises(ConfigError, match=r"link\.emulator: unknown emulator 'netem'"):
        emulator_class("netem", local)


def test_per_device_and_per_pair_rates_in_either_form():
    from testbed.link.rates import rate_overrides

    link = parse_experiment(
        with_(
            devices={"count": [2, 3]},
            link={
                "uplink_mbit": [2, 10.5],
                "downlink_mbit": {"2": 3},  # as JSON keys come back
                "pair_mbit": {"0->1": 1, " 2 -> 0 ": 4.0},
            },
        )
    ).link
    assert link.uplink_mbit == {0: 2.0, 1: 10.5}
    assert link.downlink_mbit == {2: 3.0}
    assert link.pair_mbit == {"0->1": 1.0, "2->0": 4.0}
    assert link.pairs() == {(0, 1): 1.0, (2, 0): 4.0}
    rates = rate_overrides(link).resolve(5.0, 2)  # device 2 is not in a 2-device trial
    assert rates.uplink_mbit == (2.0, 10.5) and rates.downlink_mbit == (None, None)
    assert rates.pair_mbit == {(0, 1): 1.0}
    assert parse_experiment(MINIMAL).link.uplink_mbit == {}


def test_impairment_variants_expand_between_rate_and_method():
    experiment = parse_experiment(
        with_(
            link={"bandwidth_mbit": [1, 10], "impairments": [{"delay_ms": 0}, {"delay_ms": 20}]},
            methods=[{"name": "voltage"}, {"name": "trace-b", "K": 1024}],
        )
    )
    trials = plan_trials(experiment)
    assert [(t.bandwidth_mbit, t.impairments, t.method) for t in trials[:4]] == [
        (1, {"delay_ms": 0}, "voltage"),
        (1, {"delay_ms": 0}, "trace-b"),
        (1, {"delay_ms": 20}, "voltage"),
        (1, {"delay_ms": 20}, "trace-b"),
    ]
    assert trials[2].trial_id == "p2-voltage-1mbit-delay20ms"
    assert session_id(trials[2]) == "p2-1mbit-delay20ms"
    rows = {(r.trial_id, r.rank): r for r in plan_rows(experiment, trials)}
    voltage = rows[(trials[2].trial_id, 0)]
    assert voltage.analytic_delay_ms > 0
    assert voltage.analytic_delay_ms % 20 == 0
    assert rows[(trials[0].trial_id, 0)].analytic_delay_ms == 0


def test_impairment_labels():
    assert impairment_label({"delay_ms": 5, "loss_pct": 1}) == "delay5ms-loss1pct"
    assert impairment_label({"loss_gemodel": {"p_pct": 0.25, "r_pct": 25}}) == "gemodelp0.25r25"
    assert impairment_label({"reorder_gap": 3}) == "reordergap3"
    assert impairment_label({}) == "none"


def test_a_variant_naming_a_loss_model_replaces_the_profiles():
    lte = load_profile("lte")
    assert lte.loss_pct > 0
    laid = lte.with_impairments({"loss_gemodel": {"p_pct": 1, "r_pct": 20}})
    assert laid.loss_pct == 0 and laid.loss_gemodel.r_pct == 20
    assert laid.delay_ms == lte.delay_ms and laid.jitter_ms == lte.jitter_ms
    assert lte.with_impairments({"delay_ms": 0, "jitter_ms": 0}).loss_pct == lte.loss_pct


def test_the_readmes_impairment_line_plans_and_delay_0_drops_what_needs_a_delay():
    """The README's commented `link:` line over `lte` (30 ms, jitter 10 ms, loss 0.5%):
    {delay_ms: 0} is no delay and no jitter, the profile's loss kept; {delay_ms: 20,
    loss_pct: 1} keeps the jitter and replaces the loss."""
    (line,) = [
        text.removeprefix("# ")
        for text in (ROOT / "README.md").read_text().splitlines()
        if text.startswith("# link: {profile: lte, impairments:")
    ]
    experiment = parse_experiment(with_(**yaml.safe_load(line)))
    trials = plan_trials(experiment)
    assert plan_rows(experiment, trials)
    lte = load_profile("lte")
    assert (lte.delay_ms, lte.jitter_ms, lte.loss_pct) == (30, 10, 0.5)
    no_delay, delayed = (link_profile(experiment, trial).impairments() for trial in trials)
    assert no_delay == {**lte.impairments(), "delay_ms": 0, "jitter_ms": 0}
    assert delayed == {**lte.impairments(), "delay_ms": 20, "loss_pct": 1}


def test_a_variant_at_delay_0_drops_the_profiles_jitter_and_reordering_unless_it_names_them():
    jittery = parse_profile(
        {
            "name": "j",
            "delay_ms": 10,
            "jitter_ms": 5,
            "delay_correlation_pct": 25,
            "delay_distribution": "normal",
            "reorder_pct": 10,
            "reorder_gap": 3,
            "duplicate_pct": 1,
        }
    )
    laid = jittery.with_impairments({"delay_ms": 0})
    assert laid.impairments() == {**parse_profile({"name": "j"}).impairments(), "duplicate_pct": 1}
    with pytest.raises(ImpairmentError, match="jitter_ms: "):
        jittery.with_impairments({"delay_ms": 0, "jitter_ms": 5})
    assert jittery.with_impairments({"delay_ms": 5}).jitter_ms == 5  # a delay keeps it


def test_a_devices_own_uplink_impairments_and_what_its_peers_wait_for():
    experiment = parse_experiment(
        with_(
            devices={"count": [2, 3]},
            link={"bandwidth_mbit": [10], "uplink_impairments": {1: {"delay_ms": 30}}},
            methods=[{"name": "voltage"}],
        )
    )
    two, three = plan_trials(experiment)
    uplinks = device_profiles(experiment, three)
    assert [uplinks[rank].delay_ms for rank in range(3)] == [0, 30, 0]
    rows = {(r.devices, r.rank): r for r in plan_rows(experiment, [two, three])}
    # a device waits for its slowest peer's message: device 1's, 30 ms late, except device 1
    assert rows[(2, 0)].analytic_delay_ms > 0 and rows[(2, 1)].analytic_delay_ms == 0
    assert rows[(3, 2)].analytic_delay_ms == rows[(3, 0)].analytic_delay_ms > 0
    assert rows[(3, 0)].analytic_delay_ms % 30 == 0


def test_a_pairs_and_a_downlinks_delay_add_to_what_the_receiver_waits_for():
    """0 -> 1 crosses 0's uplink (5 ms), the pair's hop (40 ms) and 1's downlink (10 ms);
    1 -> 0 only 1's uplink (5 ms)."""
    experiment = parse_experiment(
        with_(
            link={
                "bandwidth_mbit": [10],
                "uplink_impairments": [{"delay_ms": 5}, {"delay_ms": 5}],
                "downlink_impairments": {1: {"delay_ms": 10}},
                "pair_impairments": {"0->1": {"delay_ms": 40, "loss_pct": 1}},
            },
            methods=[{"name": "voltage"}],
        )
    )
    assert experiment.link.impaired_pairs() == {(0, 1): {"delay_ms": 40, "loss_pct": 1}}
    rows = {r.rank: r for r in plan_rows(experiment, plan_trials(experiment))}
    messages = rows[0].analytic_delay_ms / 5
    assert rows[1].analytic_delay_ms == pytest.approx(messages * 55)


def test_a_section_read_before_the_backends_are_imported_says_how_to_register_it():
    """Without the backend table, `inventory:` is not known yet: the error says what to import."""
    script = (
        "from testbed.experiment.schema import parse_experiment\n"
        "try:\n"
        "    parse_experiment({'name': 'x', 'methods': [{'name': 'voltage'}], 'inventory': {}})\n"
        "except Exception as error:\n"
        "    print(error)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == (
        "<experiment>: inventory: unknown key "
        "(a backend's section is known once `import testbed.backends.table` ran)"
    )
