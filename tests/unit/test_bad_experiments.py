"""Bad experiment files, every kind: each one refused by `testbed.run FILE --dry-run` with exit
status 2, exactly one line on stderr naming the field, and nothing written under `--out`.

Most cases go through `testbed.run.main` in this process (a subprocess costs a second of
imports each); `test_real_subprocess` runs a handful end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from testbed.run import main

ROOT = Path(__file__).resolve().parents[2]
TOO_MANY_CPUS = (os.cpu_count() or 1) + 1
BOARDS = (
    "inventory: {known_hosts: kh, accept_new_host_keys: true, boards: ["
    "{name: a, address: 10.0.0.1, user: u}, {name: b, address: 10.0.0.2, user: u}]}\n"
)
VOLTAGE = "methods: [{name: voltage}]\n"
TRACE64 = "methods: [{name: trace-b, K: 64, level_k: auto}]\n"


def exp(body: str, methods: str = VOLTAGE, name: str = "name: bad\n") -> str:
    return name + body + methods


def levels_csv(K: int, variants: tuple[str, ...] = ("kmeans", "ema"), top1: float = 50.0) -> str:
    """An accuracy study's table7_levels.csv: trace-b at P=2, every level of a K tree."""
    from tracevq.codec import level_sizes_for

    lines = ["method,variant,metric,devices,level,level_k,mean,std,min,max,n"]
    for variant in variants:
        for level, level_k in enumerate(level_sizes_for(K, 2)):
            lines.append(f"trace-b,{variant},euclidean,2,{level},{level_k},{top1},0,0,100,3")
    return "\n".join(lines) + "\n"


def report(table: str, extra: str = "") -> str:
    return f"report: {{level_accuracy: {{tmp}}/{table}{extra}}}\n"


# (case id, experiment text (`{tmp}` is the test's directory), text the one line must hold)
CASES: list[tuple[str, str, str]] = [
    # a fleet: per-device resources, speeds, rates, profiles and partitions (docs/devices.md)
    ("cpus-rank-out", exp("devices: {cpus: [1, 0.5, 1]}\n"), "devices.cpus: device 2 does not"),
    ("cpus-zero-one", exp("devices: {cpus: {1: 0}}\n"), "devices.cpus: device 1: 0 is not in"),
    ("cpus-word", exp("devices: {cpus: fast}\n"), "devices.cpus: cpus: a number, got 'fast'"),
    ("memory-small-one", exp("devices: {memory_mb: {0: 64}}\n"), "64 is not in 128..1,048,576"),
    ("speed-zero", exp("devices: {speed: {1: 0}}\n"), "devices.speed: device 1: a speed is"),
    (
        "speed-fast",
        exp("devices: {speed: [1, 1.5]}\n"),
        "dilation: 1 is too low for P=2: device 1 computes at 1.50 of a host core "
        "per core, which needs a dilation of at least 1.50 (dilation: auto picks",
    ),
    ("speed-past-max", exp("devices: {speed: {1: 250}}\n"), "device 1: 250 is more than 100"),
    ("dilation-low", exp("dilation: 0.5\n"), "dilation: 0.5 is no dilation: a number in 1..100"),
    ("speed-rank-out", exp("devices: {speed: {2: 0.5}}\n"), "devices.speed: device 2 does not"),
    ("gflops-negative", exp("devices: {gflops: -3}\n"), "devices.gflops: gflops: -3 is not in"),
    (
        "speed-and-gflops",
        exp("devices: {speed: {1: 0.5}, gflops: {1: 20}}\n"),
        "devices: device 1 has both gflops and speed; give one",
    ),
    (
        "device-profile-unknown",
        exp("devices: {profile: {1: potato}}\n"),
        "unknown device profile 'pot",
    ),
    ("partition-sum", exp("devices: {partition: [100, 50]}\n"), "holds 150 tokens, vit-b16 has"),
    (
        "partition-count",
        exp("devices: {count: [2, 3], partition: [100, 97]}\n"),
        "devices.partition: 2 token counts, but devices.count is [2, 3]",
    ),
    ("partition-word", exp("devices: {partition: by_rate}\n"), "'by_rate' is none of even, by_"),
    ("partition-zero", exp("devices: {partition: [197, 0]}\n"), "partition[1]: 0 is not in 1.."),
    ("variant-typo", exp("devices: {variants: [{sped: {1: 0.5}}]}\n"), "variants[0].sped: unkn"),
    # a timeline of events: the event's index and field named
    (
        "event-unknown-device",
        exp("timeline: [{at_s: 1, device: 5, speed: 0.5}]\n"),
        "timeline[0].device: device 5 does not exist: devices.count is at most 2",
    ),
    (
        "event-past-repeats",
        exp("repeats: 4\ntimeline: [{at_inference: 4, device: 1, speed: 0.5}]\n"),
        "timeline[0].at_inference: 4 is past the session: each trial measures 4 inferences",
    ),
    (
        "event-past-timeout",
        exp("timeout_s: 30\ntimeline: [{at_s: 40, device: 1, speed: 0.5}]\n"),
        "timeline[0].at_s: 40 s is past the session",
    ),
    (
        "event-fast",
        exp("timeline: [{at_s: 1, device: 1, speed: 2}]\n"),
        "dilation: 1 is too low for P=2: device 1 computes at 2.00 of a host core per core",
    ),
    ("event-past-max", exp("timeline: [{at_s: 1, device: 1, speed: 101}]\n"), "101 is not a"),
    (
        "event-two-kinds",
        exp("timeline: [{at_s: 1, device: 1, speed: 0.5, leave: true}]\n"),
        "timeline[0]: an event is one of speed, pause_s, leave, link; this one has speed and leave",
    ),
    ("event-no-time", exp("timeline: [{device: 1, leave: true}]\n"), "timeline[0]: give at_s"),
    (
        "pause-over-leave",
        exp("timeline: [{at_s: 1, device: 1, pause_s: 2}, {at_s: 2, device: 1, leave: true}]\n"),
        "timeline[0]: device 1's pause (2 s from 1 s) overlaps its leave at 2 s (timeline[1])",
    ),
    (
        "event-after-leave",
        exp("timeline: [{at_s: 1, device: 1, leave: true}, {at_s: 2, device: 1, speed: 0.5}]\n"),
        "timeline[1]: device 1 left at 1 s (timeline[0])",
    ),
    (
        "event-link-rate",
        exp("timeline: [{at_s: 1, device: 1, link: {rate_mbit: 0}}]\n"),
        "timeline[0].link: rate_mbit: a number of Mbit/s in 0.01..10,000, got 0",
    ),
    (
        "event-link-typo",
        exp("timeline: [{at_s: 1, device: 1, link: {delay: 5}}]\n"),
        "timeline[0].link: delay: not an impairment (did you mean 'delay_ms'?)",
    ),
    ("leave-false", exp("timeline: [{at_s: 1, device: 1, leave: false}]\n"), "leave: true, or"),
    # numbers: finite, in range, no booleans or strings as numbers
    ("rate-nan", exp("link: {bandwidth_mbit: .nan}\n"), "link.bandwidth_mbit[0]: "),
    ("rate-inf", exp("link: {bandwidth_mbit: [1, .inf]}\n"), "link.bandwidth_mbit[1]: "),
    ("rate-1e15", exp("link: {bandwidth_mbit: 1e15}\n"), "'1e15', which YAML reads as text"),
    ("rate-1.0e+15", exp("link: {bandwidth_mbit: 1.0e+15}\n"), "link.bandwidth_mbit: every"),
    ("rate-bool", exp("link: {bandwidth_mbit: [true]}\n"), "link.bandwidth_mbit[0]: "),
    ("rate-zero", exp("link: {bandwidth_mbit: 0}\n"), "link.bandwidth_mbit: "),
    ("rate-negative", exp("link: {bandwidth_mbit: [10, -5]}\n"), "link.bandwidth_mbit: "),
    ("rate-too-small", exp("link: {bandwidth_mbit: 0.001}\n"), "0.01..10,000 Mbit/s"),
    ("rate-string", exp("link: {bandwidth_mbit: '10'}\n"), "link.bandwidth_mbit[0]: "),
    ("rate-empty", exp("link: {bandwidth_mbit: []}\n"), "link.bandwidth_mbit: "),
    ("probe-zero", exp("link: {probe_s: 0}\n"), "link.probe_s: "),
    # per-device and per-pair rates: the field and the device named
    (
        "uplink-rank-out",
        exp("link: {uplink_mbit: {2: 5}}\n"),
        "link.uplink_mbit: device 2 does not exist: devices.count is at most 2",
    ),
    (
        "uplink-list-too-long",
        exp("link: {uplink_mbit: [1, 2, 3]}\n"),
        "link.uplink_mbit: device 2 does not exist",
    ),
    (
        "downlink-rank-out",
        exp("devices: {count: [2, 3]}\nlink: {downlink_mbit: {3: 5}}\n"),
        "link.downlink_mbit: device 3 does not exist: devices.count is at most 3",
    ),
    (
        "uplink-negative",
        exp("link: {uplink_mbit: {1: -2}}\n"),
        "link.uplink_mbit: device 1: a rate is a number of Mbit/s in 0.01..10,000, got -2",
    ),
    ("uplink-nan", exp("link: {uplink_mbit: [.nan]}\n"), "link.uplink_mbit: device 0: "),
    ("downlink-zero", exp("link: {downlink_mbit: {0: 0}}\n"), "link.downlink_mbit: device 0: "),
    ("downlink-bool", exp("link: {downlink_mbit: {0: true}}\n"), "link.downlink_mbit: device 0: "),
    ("uplink-string", exp("link: {uplink_mbit: {0: '5'}}\n"), "link.uplink_mbit: device 0: "),
    (
        "uplink-rank-text",
        exp("link: {uplink_mbit: {first: 5}}\n"),
        "link.uplink_mbit: device 'first': a device is named by its rank",
    ),
    ("uplink-scalar", exp("link: {uplink_mbit: 5}\n"), "link.uplink_mbit: a mapping"),
    (
        "pair-syntax",
        exp("link: {pair_mbit: {0-1: 2}}\n"),
        "link.pair_mbit: pair '0-1': a pair is written \"SRC->DST\"",
    ),
    ("pair-self", exp("link: {pair_mbit: {1->1: 2}}\n"), "link.pair_mbit: pair '1->1': a device"),
    ("pair-nan", exp("link: {pair_mbit: {0->1: .nan}}\n"), "link.pair_mbit: pair 0->1: "),
    (
        "pair-rank-out",
        exp("link: {pair_mbit: {0->4: 2}}\n"),
        "link.pair_mbit: device 4 does not exist",
    ),
    ("pair-list", exp("link: {pair_mbit: [2]}\n"), "link.pair_mbit: a mapping"),
    (
        "pair-with-netem",
        exp("link: {profile: wifi, emulator: tbf, pair_mbit: {0->1: 2}}\n"),
        "link.pair_mbit: per-pair rates with profile 'wifi'",
    ),
    (
        "downlink-on-boards",
        exp(BOARDS + "backend: ssh\nlink: {downlink_mbit: {0: 5}}\n"),
        "link.downlink_mbit: the ssh backend shapes uplinks only",
    ),
    (
        "pair-on-boards",
        exp(BOARDS + "backend: ssh\nlink: {pair_mbit: {0->1: 5}}\n"),
        "link.pair_mbit: the ssh backend shapes uplinks only",
    ),
    ("probe-inf", exp("link: {probe_s: .inf}\n"), "link.probe_s: "),
    ("cpus-inf", exp("devices: {cpus: .inf}\n"), "devices.cpus: "),
    ("cpus-nan", exp("devices: {cpus: .nan}\n"), "devices.cpus: "),
    ("cpus-zero", exp("devices: {cpus: 0}\n"), "devices.cpus: "),
    ("cpus-bool", exp("devices: {cpus: true}\n"), "devices.cpus: "),
    ("cpus-over-host", exp(f"devices: {{cpus: {TOO_MANY_CPUS}}}\n"), "oversubscribe: true"),
    ("oversubscribe-str", exp("devices: {oversubscribe: 'yes'}\n"), "devices.oversubscribe: "),
    ("memory-small", exp("devices: {memory_mb: 64}\n"), "devices.memory_mb: "),
    ("memory-float", exp("devices: {memory_mb: 1.5}\n"), "devices.memory_mb: "),
    ("count-zero", exp("devices: {count: 0}\n"), "devices.count: "),
    ("count-negative", exp("devices: {count: [2, -1]}\n"), "devices.count: "),
    ("count-huge", exp("devices: {count: 1000}\n"), "devices.count: "),
    ("count-bool", exp("devices: {count: true}\n"), "devices.count[0]: "),
    ("count-over-tokens", exp("model: {name: vit-tiny}\ndevices: {count: 18}\n"), "17 tokens"),
    ("timeout-inf", exp("timeout_s: .inf\n"), "timeout_s: "),
    ("timeout-nan", exp("timeout_s: .nan\n"), "timeout_s: "),
    ("timeout-zero", exp("timeout_s: 0\n"), "timeout_s: "),
    ("timeout-negative", exp("timeout_s: -1\n"), "timeout_s: "),
    ("repeats-zero", exp("repeats: 0\n"), "repeats: "),
    ("repeats-float", exp("repeats: 2.5\n"), "repeats: "),
    ("warmup-negative", exp("warmup: -1\n"), "warmup: "),
    ("batch-zero", exp("batch: 0\n"), "batch: "),
    ("seed-negative", exp("model: {seed: -1}\n"), "model.seed: "),
    ("calibration-zero", exp("bundle: {calibration_inputs: 0}\n"), "bundle.calibration_inputs"),
    ("bundle-K-one", exp("bundle: {K: 1}\n"), "bundle.K: "),
    ("evaluation-limit", exp("evaluation: {inputs: x.pt, limit: 0}\n"), "evaluation.limit: "),
    # methods
    ("method-name-number", exp("", "methods: [{name: 5}]\n"), "methods[0].name: "),
    ("method-name-null", exp("", "methods: [{name: null}]\n"), "methods[0].name: "),
    ("method-unknown", exp("", "methods: [{name: voltge}]\n"), "methods[0].name: unknown"),
    ("method-K-nan", exp("", "methods: [{name: astra, K: .nan}]\n"), "methods[0].K: "),
    ("method-K-bool", exp("", "methods: [{name: astra, K: true}]\n"), "methods[0].K: "),
    ("method-segment-bool", exp("", "methods: [{name: prism, segment: true}]\n"), ".segment: "),
    ("method-buffers-int", exp("", "methods: [{name: trace-b, buffers: 1}]\n"), ".buffers: "),
    ("method-mean-bits", exp("", "methods: [{name: prism, mean_bits: 8}]\n"), ".mean_bits: "),
    (
        "single-on-two-devices",
        exp("devices: {count: [1, 2]}\n", "methods: [{name: voltage}, {name: single}]\n"),
        "methods[1]: method 'single' runs on one device, but devices.count is [1, 2]",
    ),
    ("level-not-in-tree", exp("", "methods: [{name: trace-b, K: 64, level_k: 48}]\n"), "32, 64"),
    (
        "floor-not-in-tree",
        exp("", "methods: [{name: trace-b, K: 64, level_k: auto, level_min_k: 12}]\n"),
        "methods[0].level_min_k: 12 is not a level of the K=64 codebook tree",
    ),
    (
        "floor-without-auto",
        exp("", "methods: [{name: trace-nb, K: 64, level_min_k: 16}]\n"),
        "methods[0].level_min_k: method 'trace-nb': level_min_k bounds level_k: auto from below",
    ),
    ("level-odd", exp("", "methods: [{name: trace-nb, K: 1024, level_k: 3}]\n"), ".level_k: "),
    ("level-over-K", exp("", "methods: [{name: trace-b, K: 64, level_k: 128}]\n"), ".level_k: "),
    ("level-in-grid", exp("", "methods: [{name: trace-b, K: 100, level_k: [50, 64]}]\n"), "7, 13"),
    (
        "placement-unknown",
        exp("", "methods: [{name: trace-nb, placement: '1 C'}]\n"),
        "methods[0].placement: method 'trace-nb': placement must be one of '1 A.i'",
    ),
    (
        "placement-other-method",
        exp("", "methods: [{name: trace-b, placement: [2 B, 1 B]}]\n"),
        ".placement: method 'trace-b': placement '1 B' is a case of 'trace-nb'",
    ),
    ("methods-empty", exp("", "methods: []\n"), "methods: "),
    ("methods-missing", exp("", ""), "methods: Field required"),
    ("method-no-name", exp("", "methods: [{K: 3}]\n"), "methods[0]: needs a 'name'"),
    ("method-typo", exp("", "methods: [{name: trace-b, levle_k: 4}]\n"), "methods[0].levle_k"),
    (
        "grid-alias-bomb",
        "name: bomb\na: &a [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n"
        "methods: [{name: astra, K: *a, b: *a, c: *a, d: *a, e: *a, f: *a, g: *a, h: *a, i: *a}]\n",
        "1,000,000,000 trials; at most 10,000",
    ),
    (
        "grid-plain-lists",
        exp(
            "link: {bandwidth_mbit: [" + ", ".join(str(r) for r in range(1, 201)) + "]}\n",
            "methods: [{name: astra, K: [" + ", ".join(str(k) for k in range(2, 62)) + "]}]\n",
        ),
        "12,000 trials",
    ),
    # names used as directories
    ("name-dotdot", exp("", name="name: ../../x\n"), "name: experiment name '../../x'"),
    ("name-absolute", exp("", name="name: /abs/path\n"), "name: experiment name '/abs/path'"),
    ("name-nested", exp("", name="name: a/b/c\n"), "name: experiment name 'a/b/c'"),
    ("name-empty", exp("", name="name: ''\n"), "name: experiment name ''"),
    ("name-dot", exp("", name="name: .\n"), "name: experiment name '.'"),
    ("name-parent", exp("", name="name: '..'\n"), "name: experiment name '..'"),
    ("name-space", exp("", name="name: my run\n"), "name: experiment name 'my run'"),
    ("name-number", exp("", name="name: 123\n"), "name: Input should be a valid string"),
    ("name-missing", exp("", name=""), "name: Field required"),
    # link profile and emulator
    ("profile-unknown", exp("link: {profile: lan}\n"), "link.profile: unknown link profile"),
    ("profile-slug", exp("link: {profile: '..'}\n"), "link.profile: profile name '..'"),
    ("profile-no-file", exp("link: {profile: ../nope.yaml}\n"), "link.profile: "),
    ("profile-bad-rate", exp("link: {profile: {tmp}/nan.yaml}\n"), "link.profile: "),
    ("profile-duplicate", exp("link: {profile: {tmp}/dup.yaml}\n"), "duplicate key 'delay_ms'"),
    # impairment variants: the variant named, alone and over the profile
    ("variants-empty", exp("link: {impairments: []}\n"), "link.impairments: give at least one"),
    ("variants-not-list", exp("link: {impairments: 5}\n"), "link.impairments: Input should be"),
    (
        "variant-misspelt",
        exp("link: {impairments: [{delay_ms: 0}, {dlay_ms: 1}]}\n"),
        "link.impairments: variant 1: dlay_ms: not an impairment (did you mean 'delay_ms'?)",
    ),
    (
        "variant-out-of-range",
        exp("link: {impairments: [{loss_pct: 120}]}\n"),
        "link.impairments: variant 0: loss_pct: must lie in 0..100, got 120",
    ),
    (
        "impairment-variant-twice",
        exp("link: {impairments: [{delay_ms: 1}, {delay_ms: 1}]}\n"),
        "link.impairments: impairment variant '{\"delay_ms\": 1}' is listed twice",
    ),
    (
        "variant-jitter-over-ideal",
        exp("link: {impairments: [{jitter_ms: 2}]}\n"),
        "link.impairments: variant {\"jitter_ms\": 2} over profile 'ideal': jitter_ms: jitter "
        "needs a delay",
    ),
    (
        "variant-pair-rates-tbf",
        exp("link: {impairments: [{delay_ms: 5}], emulator: tbf, pair_mbit: {'0->1': 3}}\n"),
        "link.pair_mbit: per-pair rates with profile 'variant 0 over ideal'",
    ),
    (
        "uplink-impairment-unknown",
        exp("link: {uplink_impairments: {1: {dely_ms: 5}}}\n"),
        "link.uplink_impairments: device 1: dely_ms: not an impairment (did you mean 'delay_ms'?)",
    ),
    (
        "uplink-impairment-rank-out",
        exp("link: {uplink_impairments: {2: {delay_ms: 5}}}\n"),
        "link.uplink_impairments: device 2 does not exist: devices.count is at most 2",
    ),
    (
        "uplink-impairment-not-mapping",
        exp("link: {uplink_impairments: {0: 5}}\n"),
        "link.uplink_impairments: device 0: a mapping of netem's parameters, got 5",
    ),
    (
        "uplink-impairment-jitter-alone",
        exp("link: {uplink_impairments: {0: {jitter_ms: 5}}}\n"),
        "link.uplink_impairments: device 0 over profile 'ideal': jitter_ms: jitter needs a delay",
    ),
    (
        "uplink-impairment-tbf",
        exp(
            "link: {uplink_impairments: {0: {delay_ms: 5}}, emulator: tbf,\n"
            "       pair_mbit: {'0->1': 3}}\n"
        ),
        "link.pair_mbit: per-pair rates with profile 'device 0's uplink'",
    ),
    (
        "downlink-impairment-jitter-alone",
        exp("link: {downlink_impairments: {1: {jitter_ms: 5}}}\n"),
        "link.downlink_impairments: device 1: jitter_ms: jitter needs a delay",
    ),
    (
        "downlink-impairment-rank-out",
        exp("link: {downlink_impairments: {3: {delay_ms: 5}}}\n"),
        "link.downlink_impairments: device 3 does not exist: devices.count is at most 2",
    ),
    (
        "pair-impairment-self",
        exp("link: {pair_impairments: {'1->1': {delay_ms: 5}}}\n"),
        "link.pair_impairments: pair '1->1': a device does not send to itself",
    ),
    (
        "pair-impairment-loss-range",
        exp("link: {pair_impairments: {'0->1': {loss_pct: -1}}}\n"),
        "link.pair_impairments: pair 0->1: loss_pct: must lie in 0..100, got -1",
    ),
    (
        "pair-impairment-tbf-uplink-netem",
        exp("link: {pair_impairments: {'0->1': {delay_ms: 5}}, profile: wifi, emulator: tbf}\n"),
        "link.pair_impairments: per-pair impairments with profile 'wifi' (delay, jitter or "
        "loss) are not supported on tbf; use a rate-only profile such as 'ideal', or the "
        "serial emulator",
    ),
    (
        "profile-jitter-alone",
        exp("link: {profile: {tmp}/jitter.yaml}\n"),
        "link.profile: {tmp}/jitter.yaml: invalid link profile: jitter_ms: jitter needs a delay",
    ),
    (
        "profile-ge-range",
        exp("link: {profile: {tmp}/ge.yaml}\n"),
        "loss_gemodel.p_pct: must lie in 0..100, got 120",
    ),
    (
        "profile-reorder-no-delay",
        exp("link: {profile: {tmp}/reorder.yaml}\n"),
        "reorder_pct: reordering needs a delay",
    ),
    (
        "profile-distribution",
        exp("link: {profile: {tmp}/dist.yaml}\n"),
        "delay_distribution: 'gamma' is not one of uniform, normal, pareto, paretonormal",
    ),
    (
        "profile-delay-nan",
        exp("link: {profile: {tmp}/delay-nan.yaml}\n"),
        "delay_ms: Input should be a finite number",
    ),
    ("rate-twice", exp("link: {bandwidth_mbit: [10, 5, 10]}\n"), "bandwidth 10.0 is listed twice"),
    ("count-twice", exp("devices: {count: [2, 2]}\n"), "device count 2 is listed twice"),
    (
        "variant-twice",
        exp("", "methods: [{name: astra, K: [16, 16]}]\n"),
        "methods[0]: the variant astra K=16 is listed twice",
    ),
    (
        "variant-twice-apart",
        exp("", "methods: [{name: voltage}, {name: voltage}]\n"),
        "methods[1]: the variant voltage is listed twice (as methods[0])",
    ),
    (
        "trace-and-rates",
        exp("link: {trace: step-20-2-20.csv, bandwidth_mbit: 5}\n"),
        "link.bandwidth_mbit: a trace gives the rates",
    ),
    ("trace-missing", exp("link: {trace: nope.csv}\n"), "link.trace: trace file not found"),
    ("trace-bad-rate", exp("link: {trace: {tmp}/neg.csv}\n"), "link.trace: "),
    (
        "trace-stretch-zero",
        exp("link: {trace: step-20-2-20.csv, trace_stretch: 0}\n"),
        "link.trace_stretch: ",
    ),
    (
        "tbf-duplicating-pair",
        exp(
            "devices: {count: [3]}\nlink: {emulator: tbf, pair_impairments: "
            "{'0->1': {duplicate_pct: 5}, '0->2': {delay_ms: 5}}}\n"
        ),
        "link.pair_impairments: the pair 0->1 duplicates frames beside other pairs'",
    ),
    # a shared medium (a cell: docs/cell.md)
    (
        "cell-on-tbf",
        exp("link: {medium: shared, emulator: tbf}\n"),
        "link.medium: a shared medium is scheduled by the serial emulator",
    ),
    (
        "cell-profile-on-tbf",
        exp("link: {profile: wifi-cell, emulator: tbf}\n"),
        "link.profile: a shared medium is scheduled by the serial emulator",
    ),
    (
        "cell-pair-rates",
        exp("link: {medium: [dedicated, shared], pair_mbit: {0->1: 2}}\n"),
        "link.pair_mbit: a shared medium (link.medium) is one cell",
    ),
    (
        "cell-downlink-rates",
        exp("link: {profile: wifi-cell, downlink_mbit: {1: 5}}\n"),
        "link.downlink_mbit: a shared medium (link.profile wifi-cell) is one cell",
    ),
    (
        "cell-downlink-impairments",
        exp("link: {medium: shared, downlink_impairments: {1: {delay_ms: 5}}}\n"),
        "link.downlink_impairments: a shared medium",
    ),
    (
        "cell-airtime-negative",
        exp("link: {profile: {tmp}/airtime-negative.yaml}\n"),
        "airtime_us: Input should be greater than or equal to 0",
    ),
    (
        "cell-airtime-dedicated",
        exp("link: {profile: {tmp}/airtime-dedicated.yaml}\n"),
        "airtime_us: 150 us of airtime per frame needs medium: shared",
    ),
    ("cell-medium-unknown", exp("link: {medium: air}\n"), "link.medium[0]: Input should be"),
    ("cell-medium-twice", exp("link: {medium: [shared, shared]}\n"), "medium 'shared' is listed"),
    ("emulator-unknown", exp("link: {emulator: netem}\n"), "link.emulator: unknown emulator"),
    ("emulator-serial-ssh", exp("backend: ssh\nlink: {emulator: serial}\n" + BOARDS), "serial"),
    # files the run would read
    ("checkpoint-missing", exp("model: {checkpoint: {tmp}/no.pth}\n"), "model.checkpoint: file"),
    ("checkpoint-directory", exp("model: {checkpoint: {tmp}}\n"), "model.checkpoint: not a"),
    ("evaluation-missing", exp("evaluation: {inputs: no-test.pt}\n"), "evaluation.inputs: "),
    ("bundle-missing", exp("bundle: {path: {tmp}/no-bundle.pt}\n"), "bundle.path: file not"),
    ("inventory-missing", exp("backend: ssh\ninventory: {tmp}/no.yaml\n"), "inventory: "),
    ("inventory-duplicate", exp("backend: ssh\ninventory: {tmp}/dup.yaml\n"), "duplicate key"),
    # the accuracy study's table of report.level_accuracy
    ("levels-missing", exp(report("no.csv"), TRACE64), "report.level_accuracy: file not found"),
    ("levels-empty", exp(report("empty.csv"), TRACE64), "is not a readable CSV table"),
    (
        "levels-columns",
        exp(report("cols.csv"), TRACE64),
        "cols.csv has no column variant, metric, mean (or accuracy); expected the accuracy",
    ),
    ("levels-not-percent", exp(report("pct.csv"), TRACE64), "outside 0..100 (the study's top-1"),
    (
        "levels-other-K",
        exp(report("k1024.csv"), TRACE64),
        "no row for trace-b K=64 at P=2 level_k 2, 4, 8, 16, 32, 64 (variant kmeans, metric "
        "euclidean, every level under level_k auto); it has trace-b K=1024 at P=2",
    ),
    (
        "levels-other-P",
        exp("devices: {count: [2, 3]}\n" + report("k64.csv"), TRACE64),
        "no row for trace-b K=64 at P=3 level_k 2, 4",
    ),
    (
        "levels-fixed-level",
        exp(report("k64.csv"), "methods: [{name: trace-b, K: 128, level_k: [128, 64]}]\n"),
        "no row for trace-b K=128 at P=2 level_k 128 (variant kmeans, metric euclidean); it has",
    ),
    (
        "levels-other-model",
        exp(report("study/levels.csv"), TRACE64),
        "study/levels.csv is from a study of vit-digits",
    ),
    ("levels-metric", exp("bundle: {metric: cosine}\n" + report("k64.csv"), TRACE64), "'cosine'"),
    ("levels-no-trace", exp(report("k64.csv")), "no method of this experiment uses tree levels"),
    (
        "levels-variant-unknown",
        exp(report("k64.csv", ", variant: gradient"), TRACE64),
        "report.variant: {tmp}/k64.csv has no variant 'gradient' (it has: ema, kmeans)",
    ),
    ("levels-variant-alone", exp("report: {variant: ema}\n"), "report.variant: names a variant"),
    ("levels-typo", exp("report: {level_acuracy: x}\n"), "(did you mean 'level_accuracy'?)"),
    # backends
    ("ssh-no-inventory", exp("backend: ssh\n"), "inventory: backend 'ssh' needs an inventory"),
    (
        "ssh-board-typo",
        exp("backend: ssh\n" + BOARDS.replace("user: u}]", "user: u, prot: 22}]")),
        "inventory.boards[1].prot: unknown key (did you mean 'port'?)",
    ),
    (
        "enoslib-provider-typo",
        exp(
            "backend: enoslib\nprovider: {kind: static, known_hosts: kh, rol: devices, "
            "conf: {resources: {machines: [], networks: []}}}\n"
        ),
        "provider.rol: unknown key (did you mean 'role'?)",
    ),
    ("ssh-too-few-boards", exp("backend: ssh\ndevices: {count: 3}\n" + BOARDS), "devices.count"),
    ("ssh-bad-port", exp("backend: ssh\n" + BOARDS.replace("u}]", "u, port: 70000}]")), "port"),
    (
        "ssh-no-known-hosts",
        exp(
            "backend: ssh\n" + BOARDS.replace("accept_new_host_keys: true", "connect_timeout_s: 5")
        ),
        "inventory.known_hosts: file not found",
    ),
    (
        "ssh-no-key-file",
        exp("backend: ssh\n" + BOARDS.replace("user: u}, {", "user: u, key_file: {tmp}/k}, {")),
        "inventory.boards[0].key_file: file not found",
    ),
    ("backend-unknown", exp("backend: podman\n"), "backend: unknown backend 'podman'"),
    ("model-unknown", exp("model: {name: vit-b17}\n"), "model.name: unknown model"),
    # the file itself
    ("duplicate-top-key", exp("name: again\n"), "line 2, column 1: duplicate key 'name'"),
    ("duplicate-nested", exp("devices: {cpus: 1, cpus: 2}\n"), "duplicate key 'cpus'"),
    ("syntax-error", exp("link: {bandwidth_mbit: [1, 2}\n"), "not valid YAML: line 2, column"),
    ("tab-indent", "name: x\n\tmethods: []\n", "not valid YAML: line 2, column 1"),
    ("empty-file", "", "empty; an experiment needs at least `name:` and `methods:`"),
    ("comments-only", "# nothing yet\n", "empty; an experiment needs"),
    ("list-at-top", "- name: x\n", "an experiment is a mapping of keys, got list"),
    ("unknown-key", exp("modle: {}\n"), "modle: unknown key (did you mean 'model'?)"),
    ("unknown-nested-key", exp("devices: {cout: 2}\n"), "devices.cout: unknown key"),
    ("deep-nesting", "name: x\nmethods: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
]

AUXILIARY = {
    "nan.yaml": "rate_mbit: .nan\n",
    "dup.yaml": "delay_ms: 1\ndelay_ms: 2\n",
    "jitter.yaml": "jitter_ms: 2\n",
    "ge.yaml": "loss_gemodel: {p_pct: 120}\n",
    "reorder.yaml": "reorder_pct: 5\n",
    "dist.yaml": "delay_ms: 5\njitter_ms: 1\ndelay_distribution: gamma\n",
    "delay-nan.yaml": "delay_ms: .nan\n",
    "airtime-negative.yaml": "medium: shared\nairtime_us: -5\n",
    "airtime-dedicated.yaml": "airtime_us: 150\n",
    "neg.csv": "t_s,mbit\n0,5\n10,-1\n20,\n",
    "empty.csv": "",
    "cols.csv": "method,devices,level_k,top1\ntrace-b,2,64,50\n",
    "pct.csv": levels_csv(64, top1=120.0),
    "k64.csv": levels_csv(64),
    "k1024.csv": levels_csv(1024),
    "study/levels.csv": levels_csv(64),
    "study/settings.yaml": "name: digits\nmodel: {name: vit-digits}\n",
}


def refused(capsys, tmp_path: Path, args: list[str]) -> str:
    """Runs `testbed.run` with `args`; asserts exit 2, one line, nothing written; the line."""
    out = tmp_path / "out"
    status = main([*args, "--dry-run", "--out", str(out)])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert status == 2, captured
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("testbed.run: ")
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_experiment_is_refused_in_one_line(capsys, tmp_path, text, expected):
    for name, content in AUXILIARY.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(content)
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("{tmp}", str(tmp_path)))
    line = refused(capsys, tmp_path, [str(path)])
    assert expected.replace("{tmp}", str(tmp_path)) in line
    assert f"{path}: " in line


def test_case_ids_are_distinct_and_many():
    assert len({c[0] for c in CASES}) == len(CASES) >= 60


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x7fELF\x02\x01\x01\x00\x00\x00", "a binary file (NUL bytes)"),
        (b"name: caf\xe9\n", "not UTF-8 text (byte 9)"),
    ],
    ids=["binary", "latin-1"],
)
def test_files_that_are_not_yaml_text(capsys, tmp_path, content, expected):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    assert expected in refused(capsys, tmp_path, [str(path)])


def test_a_directory_or_a_missing_file(capsys, tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    assert "is a directory" in refused(capsys, tmp_path, [str(tmp_path / "dir.yaml")])
    assert "not found" in refused(capsys, tmp_path, [str(tmp_path / "none.yaml")])


def test_an_unusable_out(capsys, tmp_path):
    good = str(ROOT / "experiments" / "smoke.yaml")
    a_file = tmp_path / "a-file"
    a_file.write_text("kept\n")
    for out in (a_file, a_file / "below", Path("/proc/testbed-out")):
        status = main([good, "--dry-run", "--out", str(out)])
        lines = capsys.readouterr().err.splitlines()
        assert status == 2 and len(lines) == 1 and f"--out {out}: " in lines[0], lines
    assert a_file.read_text() == "kept\n" and not Path("/proc/testbed-out").exists()


def test_usage_errors_are_one_line(capsys, tmp_path):
    for args in (["--bogus"], []):
        with pytest.raises(SystemExit) as stopped:
            main(args)
        assert stopped.value.code == 2
        assert len(capsys.readouterr().err.splitlines()) == 1
    assert main(["--resume", str(tmp_path / "no-run")]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="the netem probe needs root")
def test_a_profile_needing_netem_on_a_kernel_without_it(capsys, tmp_path):
    from testbed.kernel.support import qdisc_support

    if qdisc_support().get("netem"):
        pytest.skip("this kernel has sch_netem")
    path = tmp_path / "bad.yaml"
    path.write_text(exp("link: {profile: lte, emulator: tbf}\n"))
    assert "link.profile: 'lte' needs netem's impairments" in refused(capsys, tmp_path, [str(path)])
    path.write_text(exp("link: {downlink_impairments: {1: {loss_pct: 1}}, emulator: tbf}\n"))
    assert "link.downlink_impairments: needs netem's impairments (sch_netem)" in refused(
        capsys, tmp_path, [str(path)]
    )


def test_an_unexpected_error_prints_one_line_naming_the_log(capsys, tmp_path, monkeypatch):
    import testbed.sweep.plan

    def broken(*args, **kwargs):
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(testbed.sweep.plan, "plan_trials", broken)
    status = main([str(ROOT / "experiments" / "smoke.yaml"), "--dry-run", "--out", str(tmp_path)])
    lines = capsys.readouterr().err.splitlines()
    assert status == 1 and len(lines) == 1, lines
    assert "unexpected error (RuntimeError: a bug over two lines)" in lines[0]
    log_path = Path(lines[0].rsplit("the traceback is in ", 1)[1])
    try:
        assert "Traceback" in log_path.read_text() and "broken" in log_path.read_text()
    finally:
        log_path.unlink()


# The ssh and enoslib backends' sections are defined in their folders and register when the
# backend table is imported: the typos inside them are named only if the command has done so
# before it reads the file (else the line says `inventory: unknown key`).
@pytest.mark.parametrize(
    "case",
    [
        "rate-nan",
        "grid-alias-bomb",
        "syntax-error",
        "name-dotdot",
        "method-name-number",
        "ssh-board-typo",
        "enoslib-provider-typo",
    ],
)
def test_real_subprocess(tmp_path, case):
    text, expected = next((c[1], c[2]) for c in CASES if c[0] == case)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "testbed.run", str(path), "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and expected in done.stderr, done.stderr
    assert not out.exists()


def test_real_subprocess_binary_file_and_out_file(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    out_file = tmp_path / "out"
    out_file.write_text("")
    for args in ([str(binary)], [str(ROOT / "experiments" / "smoke.yaml")]):
        done = subprocess.run(
            [sys.executable, "-m", "testbed.run", *args, "--dry-run", "--out", str(out_file)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert out_file.read_text() == ""


def test_the_run_directory_stays_under_out(capsys, tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "escape").symlink_to(elsewhere)
    path = tmp_path / "e.yaml"
    path.write_text(exp("", name="name: escape\n"))
    status = main([str(path), "--dry-run", "--out", str(out)])
    lines = capsys.readouterr().err.splitlines()
    assert status == 2 and len(lines) == 1 and "outside it" in lines[0], lines
    assert list(elsewhere.iterdir()) == []


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory) -> Path:
    import torch

    import tracevq
    from tracevq.bundle import FitSettings, fit_bundle

    model = tracevq.build_model("vit-tiny")
    bundle = fit_bundle(model, torch.randn(4, 3, 32, 32), FitSettings(16, families=("trace-b",)))
    return bundle.save(tmp_path_factory.mktemp("bundle") / "b.pt")


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("{name: trace-nb, K: 16}", "has no trace-nb codebooks (it has: trace-b)"),
        ("{name: trace-b, K: 64}", "trace-b K=64, its codebooks have 16"),
        ("{name: trace-b, K: 16, level_k: 3}", "level_k=3 is not a level of its codebook tree"),
        (
            "{name: trace-b, K: 16, level_k: auto, level_min_k: 6}",
            "level_min_k=6 is not a level of its codebook tree (levels: 2, 4, 8, 16)",
        ),
    ],
    ids=["family", "K", "level", "floor"],
)
def test_a_given_bundle_without_what_the_methods_ask_for(
    capsys, tmp_path, small_bundle, method, expected
):
    path = tmp_path / "bad.yaml"
    path.write_text(
        exp(
            f"model: {{name: vit-tiny}}\nbundle: {{path: {small_bundle}}}\n",
            f"methods: [{method}]\n",
        )
    )
    line = refused(capsys, tmp_path, [str(path)])
    assert f"bundle.path: {small_bundle}" in line and expected in line


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "bundle: {path: {bundle}}\n" + report("tuned.csv"),
            "report.variant: {tmp}/tuned.csv has several fine-tuned variants (ema, gradient)",
        ),
        (
            "bundle: {path: {bundle}, metric: cosine}\n" + report("tuned.csv"),
            "bundle.metric: the trees of {bundle} are built by euclidean",
        ),
    ],
    ids=["variant-ambiguous", "bundle-metric"],
)
def test_a_level_table_beside_a_given_bundle(capsys, tmp_path, small_bundle, body, expected):
    (tmp_path / "tuned.csv").write_text(levels_csv(16, ("kmeans", "ema", "gradient")))
    path = tmp_path / "bad.yaml"
    text = exp("model: {name: vit-tiny}\n" + body, "methods: [{name: trace-b, K: 16}]\n")
    places = {"{tmp}": str(tmp_path), "{bundle}": str(small_bundle)}
    for place, value in places.items():
        text, expected = text.replace(place, value), expected.replace(place, value)
    path.write_text(text)
    assert expected in refused(capsys, tmp_path, [str(path)])


def test_a_device_faster_than_the_host_needs_a_dilation_naming_both_rates(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.setenv("TESTBED_HOST_GFLOPS", "80")
    path = tmp_path / "fast.yaml"
    path.write_text(exp("devices: {gflops: {1: 5000}}\n"))
    line = refused(capsys, tmp_path, [str(path)])
    assert (
        "dilation: 1 is too low for P=2: device 1 (gflops 5000: 5000.0 GFLOP/s on 1 CPUs, "
        "where this host gives 80.0 per core) computes at 62.50 of a host core per core, "
        "which needs a dilation of at least 62.50" in line
    )
    path.write_text(exp("devices: {profile: {0: paper-device}}\n"))
    line = refused(capsys, tmp_path, [str(path)])
    assert (
        "device 0 (profile paper-device: 182.0 GFLOP/s on 2 CPUs, where this host gives 80.0 "
        "per core) computes at 1.14 of a host core per core, which needs a dilation of at "
        "least 1.14" in line
    )
    path.write_text(exp("dilation: auto\ndevices: {profile: {0: paper-device}}\n"))
    assert main([str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr()
    assert "virtual time" in said.out + said.err, said


def test_a_rate_in_a_fleet_variant_is_planned_with_the_host_rate(capsys, tmp_path, monkeypatch):
    """A dry run of devices given as rates (here only in a variant) turns them into speeds
    with this host's rate: 40 GFLOP/s on one CPU of an 80 GFLOP/s core is speed 0.5."""
    monkeypatch.setenv("TESTBED_HOST_GFLOPS", "80")
    path = tmp_path / "rates.yaml"
    path.write_text(exp("devices: {variants: [{}, {gflops: {0: 40}}]}\n"))
    out = tmp_path / "out"
    assert main([str(path), "--dry-run", "--out", str(out)]) == 0, capsys.readouterr().err
    (plan,) = out.glob("*/*/plan.csv")
    speeds = pd.read_csv(plan).groupby("fleet", dropna=False)["device_speed"].apply(list)
    assert sorted(speeds.tolist()) == [[0.5, 1.0], [1.0, 1.0]]
