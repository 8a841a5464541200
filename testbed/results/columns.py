"""Every result column: its name, type, unit and meaning, defined once.

`testbed.results.rows` fills the columns, `testbed.results.store` writes and reads them, and the
column tables of `results/README.md` are generated from here (`python -m testbed.results.columns`);
a test checks that the README shows exactly these. Units are in the names (`_ms`, `_mbit`, `_bits`,
`_bytes`); rates are tc's Mbit (10^6 bit/s) unless the name says `paper`.

How the timing columns are measured (docs/architecture.md has the whole path): every mark is
the device's CLOCK_REALTIME in ns, and a message's arrival is the kernel's receive timestamp
of its last byte; marks of different devices are compared after adding the clock offset the
devices' handshake measured (0 within one host).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # pandas dtype: "string", "Int64", "float64", "boolean"
    unit: str  # "" for none
    meaning: str


def _table(text: str) -> list[Column]:
    """Columns from a text table: a line per column, `name dtype unit meaning`, a unit of `-`
    for none; a line that starts with spaces goes on with the meaning of the one above."""
    columns: list[list[str]] = []
    for line in text.strip("\n").splitlines():
        if line[4:5] == " ":  # the table is indented by four spaces
            columns[-1][3] += " " + line.strip()
        else:
            name, dtype, unit, meaning = line.split(maxsplit=3)
            columns.append([name, dtype, "" if unit == "-" else unit, meaning])
    return [Column(*column) for column in columns]


IDENTITY = _table(
    """
    run_id          string   -       the run (start time + 4 hex digits)
    trial_id        string   -       one method variant at one device count and bandwidth
    session_id      string   -       the worker session that ran the trial: every trial at one
                                     device count and bandwidth runs in one session, their
                                     repetitions interleaved
    experiment      string   -       the experiment's name
    backend         string   -       docker, local or ssh
    emulator        string   -       what shaped the links: tbf (kernel token bucket) or serial
                                     (userspace link clocking every frame out at the rate)
    model           string   -       the model's name
    method          string   -       voltage, prism, astra, trace-b, trace-nb (or single)
    params          string   -       the method's parameters, e.g. K=1024,level_k=32
    devices         Int64    -       P, the device count
    rank            Int64    -       this row's device
    repeat          Int64    -       measured repetition (warm-ups are not recorded); -1 on a failed
                                     trial's row
    bandwidth_mbit  float64  Mbit/s  the swept rate: every device's uplink unless link.uplink_mbit
                                     names it
    K               Int64    -       codebook size (codebook methods)
    level_k         Int64    -       codewords at the tree level in use: the level actually used,
                                     also under level_k=auto (Trace)
    r_bits          Int64    bit     bits per index at that level (Trace)
"""
)

TIMING = _table(
    """
    effective_ms            float64  ms      wall time from the input to the device's output (logits
                                             on device 0)
    compute_ms              float64  ms      effective_ms - wait_ms: the device computing
    wait_ms                 float64  ms      time blocked waiting for peers' messages: wait_peer_ms
                                             + wait_link_ms + wait_wakeup_ms
    wait_peer_ms            float64  ms      part of the wait before the last needed message had
                                             left its sender: waiting for a peer's compute
    wait_link_ms            float64  ms      part of the wait while every needed message had left
                                             and one was still on the link
    wait_wakeup_ms          float64  ms      part of the wait after the last needed byte had reached
                                             this host's kernel: threads waking up
    comm_ms                 float64  ms      sum over the device's messages of the time from the
                                             first byte offered to the kernel on the sender to the
                                             kernel's receive timestamp of the last byte at the
                                             slowest peer (clocks aligned)
    send_ms                 float64  ms      the sender's own view: sum over its messages of the
                                             time from the first byte offered to the kernel to the
                                             last byte accepted by it
    wire_comm_ms            float64  ms      frame_bytes x 8 / uplink_mbit: what the link needs for
                                             the bytes it actually carries
    analytic_comm_ms        float64  ms      messages x (P - 1) x payload_bits_per_layer /
                                             bandwidth, one message per layer (Trace's
                                             exact-embedding placements: one fewer): the paper's
                                             model (payload bits only)
    analytic_comm_ms_paper  float64  ms      the same with the paper's 1 Mbit/s = 2^20 bit/s
    analytic_delay_ms       float64  ms      messages x the link's one-way delay: what the
                                             delay adds to comm_ms (each message crosses it
                                             once on its way to the slowest peer)
"""
)

VOLUME = _table(
    """
    payload_bits_per_layer  Int64    bit     the method's payload of this device for one layer, one
                                             copy (the paper's Table II)
    payload_bits            Int64    bit     payload bits of all its messages in the inference, one
                                             copy
    message_bytes           Int64    B       bytes of its messages written to its sockets, all
                                             peers' copies (payload rounded up to whole bytes per
                                             message)
    frame_bytes             Int64    B       the Ethernet frames those bytes need, all copies: every
                                             TCP segment (at most 1448 B) with 66 B of Ethernet, IP
                                             and TCP headers
    received_bytes          Int64    B       bytes of the peers' messages it read
"""
)

CONTEXT = _table(
    """
    uplink_mbit                  float64  Mbit/s  the rate this device's uplink was shaped to:
                                                  link.uplink_mbit for the device, else
                                                  bandwidth_mbit
    downlink_mbit                float64  Mbit/s  the rate its downlink was shaped to
                                                  (link.downlink_mbit); empty when unshaped
    measured_mbit                float64  Mbit/s  TCP payload rate the probe achieved from this
                                                  device to the next after shaping (its uplink
                                                  probe)
    measured_wire_mbit           float64  Mbit/s  the same as a frame rate: measured_mbit x
                                                  1514/1448 (MTU 1500, TCP timestamps)
    downlink_measured_mbit       float64  Mbit/s  TCP payload rate the probe achieved into this
                                                  device from the peer that can send to it fastest
                                                  (its downlink probe)
    downlink_measured_wire_mbit  float64  Mbit/s  the same as a frame rate
    rate_flagged                 boolean  -       the uplink or downlink probe more than 5% off its
                                                  direction's target (as frames): the least of the
                                                  sender's uplink, the receiver's downlink and the
                                                  pair's rate
    trace                        string   -       the bandwidth trace replayed on the links during
                                                  the session (link.trace), empty for a constant
                                                  rate
    trace_s                      float64  s       with a trace: when the inference started, seconds
                                                  since the replay started (looped traces keep
                                                  counting)
    link_rate_mbit               float64  Mbit/s  the rate in force on the links when the inference
                                                  started: bandwidth_mbit, or the trace's step
                                                  applied by then
    est_rate_mbit                float64  Mbit/s  with level_k=auto: the device's own estimate of
                                                  the link rate from the previous inference's
                                                  messages, which chose this inference's level;
                                                  empty before its first estimate and for other
                                                  methods
    link_sent_bytes              Int64    B       bytes the device's link carried during the whole
                                                  session (its trials, warm-ups, handshakes, TCP/IP
                                                  headers and ACKs included)
    link_stalled_ms              float64  ms      serial emulator: how long the machine held it up
                                                  during this inference, its ports summed (stalls:
                                                  frames that left more than 1 ms late; a message
                                                  behind one arrives up to that much later); empty
                                                  on tbf links
    impairments                  string   -       the link's impairments as tc-netem's words (delay
                                                  30ms 10ms loss random 0.5%); empty: none
    link_delay_ms                float64  ms      the link's configured one-way delay (each
                                                  direction's)
    medium                       string   -       dedicated: a line per device; shared: one cell
                                                  that every device's frames take in turn
                                                  (link.medium)
    airtime_us                   float64  us      on a shared medium, what each frame adds to its
                                                  wire time (the profile's airtime_us)
    together_mbit                float64  Mbit/s  on a shared medium, the TCP payload rate the
                                                  probe achieved from this device while every
                                                  device sent at once (measured_mbit: alone)
    link_lost_frames             Int64    -       serial emulator: frames its impairments lost
                                                  during this inference, every port's; empty on
                                                  tbf links (netem's are not counted per frame)
    link_duplicated_frames       Int64    -       serial emulator: frames it sent twice during
                                                  this inference
    link_reordered_frames        Int64    -       serial emulator: frames that skipped the delay
                                                  during this inference
    tcp_retransmits              Int64    -       TCP segments this device's kernel resent to its
                                                  peers during this inference (TCP_INFO)
    clock_offset_ms              float64  ms      device 0's clock minus this device's, from the
                                                  handshake, added to this device's marks; 0
                                                  where the devices share this host's clock
    clock_uncertainty_ms         float64  ms      half the best round trip of that measurement
    kernel_timestamps            boolean  -       arrivals are the kernel's receive timestamps (else
                                                  the receiving thread's clock)
    correct                      Int64    -       correct predictions of the batch on device 0
                                                  (labelled inputs)
    level_accuracy_pct           float64  %       with report.level_accuracy: the accuracy study's
                                                  top-1 of this method, P and K at the level this
                                                  device used (level_k), its mean over the study's
                                                  seeds (testbed.experiment.level_accuracy);
                                                  empty for other methods
    batch                        Int64    -       inputs per inference
    cpus                         float64  -       this device's CPU allotment
    memory_mb                    Int64    MB      this device's memory limit
    threads                      Int64    -       the worker's torch threads
    fleet                        string   -       the fleet variant of the session
                                                  (devices.variants, e.g. speed1=0.5,by_speed);
                                                  empty without variants
    partition                    string   -       every device's tokens in rank order (131-66):
                                                  the partition in force
    tokens                       Int64    -       this device's tokens (CLS on device 0)
    device_speed                 float64  -       this device's speed when the inference started,
                                                  a fraction of its cores' own (1: full speed;
                                                  docs/devices.md)
    device_gflops                float64  GFLOP/s this device's GEMM rate in force: its rate
                                                  measured when the devices started (the model's
                                                  products, all its cores) x device_speed
    events                       string   -       the timeline's events that acted on the
                                                  session while this inference ran, or before
                                                  and still in force (speed, link), each as
                                                  `leave d1 at 2 s`, joined by '; '
    oversubscribed               boolean  -       devices x cpus exceed the host's cores
    dilation                     float64  -       virtual time: the session ran this many times
                                                  slower on the host (link rates / d, delays,
                                                  timeouts and compute x d) and every time and
                                                  rate of the row was brought back by d
                                                  (experiment.dilation; 1: real time)
    overruns                     Int64    -       stretches of this device's compute that the
                                                  host did not deliver by their paced target
                                                  during this inference (devices.pace): its
                                                  compute is longer than its speed says
    session_s                    float64  s       wall time of the session's workers (start to last
                                                  exit: loading, handshake, warm-ups and every trial
                                                  of the session)
    status                       string   -       ok, or failed
    error                        string   -       the first line of the failing worker's error,
                                                  or the timeline event a failed inference follows
"""
)

TRIAL_COLUMNS = IDENTITY + TIMING + VOLUME + CONTEXT

LAYER_MARKS = _table(
    """
    block               Int64    -       the block; its message is the one peers need at this block
                                         (Trace sends it during the previous block's FFN)
    block_start_ms      float64  ms      the block started (from the inference's start)
    departed_ms         float64  ms      its message's first byte offered to the kernel
    written_ms          float64  ms      the kernel had accepted its last byte (every copy)
    arrived_ms          float64  ms      its last byte reached the slowest peer's kernel (on this
                                         device's time axis)
    wait_start_ms       float64  ms      started waiting for the peers' messages
    wait_end_ms         float64  ms      had them all (attention starts)
    ffn_start_ms        float64  ms      the FFN started
    ffn_end_ms          float64  ms      the FFN ended
    unique_remote_keys  Int64    -       with dedup, the distinct codewords of all peers' tokens
                                         attended as remote keys (each with log(count) on its
                                         logit); empty without
"""
)

_PER_BLOCK = {
    "effective_ms",
    "analytic_comm_ms",
    "analytic_comm_ms_paper",
    "analytic_delay_ms",
    "payload_bits_per_layer",
    "correct",
}
LAYER_COLUMNS = (
    IDENTITY
    + LAYER_MARKS
    + [c for c in TIMING + VOLUME if c.name not in _PER_BLOCK]
    + [c for c in CONTEXT if c.name in ("clock_offset_ms", "kernel_timestamps")]
)

# The fidelity report (testbed.results.fidelity): configured against achieved per link.
FIDELITY_COLUMNS = _table(
    """
    session_id                 string   -       the worker session whose link this is
    devices                    Int64    -       P, the device count
    bandwidth_mbit             float64  Mbit/s  the swept rate
    emulator                   string   -       tbf or serial
    rank                       Int64    -       the device
    direction                  string   -       up: what the device sends (its port, its
                                                uplink probe, its messages to every peer);
                                                down: what it receives, where its downlink is
                                                shaped (the rate only)
    impairments                string   -       the uplink's impairments as tc-netem's words, and
                                                the later hops' (down1: ..., 0->1: ...)
    rate_target_mbit           float64  Mbit/s  the probed direction's target (frames): the least of
                                                the sender's uplink, the receiver's downlink and
                                                the pair's rate
    rate_mbit                  float64  Mbit/s  what the probe achieved, as frames
    rate_error_pct             float64  %       rate_mbit over the target, less 1
    rate_flagged               boolean  -       more than 5% off the target
    delay_messages             Int64    -       single-segment messages timed from this device to
                                                its peers in the session (every trial)
    delay_p10_ms               float64  ms      10th percentile of their link delay: kernel arrival
                                                of the last byte less departure less the frame's
                                                wire time at the path's rate
    delay_p10_low_ms           float64  ms      its 99% distribution-free interval (order
                                                statistics), low end
    delay_p10_high_ms          float64  ms      high end
    configured_delay_p10_ms    float64  ms      the same percentile of the configured delay
                                                (netem's model drawn for every hop of the path)
    delay_p50_ms               float64  ms      the median, likewise
    delay_p50_low_ms           float64  ms      its interval, low end
    delay_p50_high_ms          float64  ms      its interval, high end
    configured_delay_p50_ms    float64  ms      the configured median
    delay_p90_ms               float64  ms      the 90th percentile, likewise (judged only where
                                                nothing is lost: a lost frame's message arrives a
                                                retransmission later)
    delay_p90_low_ms           float64  ms      its interval, low end
    delay_p90_high_ms          float64  ms      its interval, high end
    configured_delay_p90_ms    float64  ms      the configured 90th percentile
    delay_flagged              boolean  -       a judged percentile configured outside its interval
                                                widened by 0.5 ms; empty: not judged
    frames                     Int64    -       frames the port's impairments drew for in the
                                                session (sent - duplicated + lost): the draws of
                                                loss and duplication (tbf: netem's passed + dropped)
    frames_sent                Int64    -       frames the port sent, every copy: the draws of
                                                reordering
    lost                       Int64    -       frames its impairments lost
    lost_pct                   float64  %       lost / frames
    lost_low_pct               float64  %       the 99% Wilson interval of lost_pct, low end
                                                (widened by the chain's design effect for a
                                                Gilbert model)
    lost_high_pct              float64  %       high end
    configured_lost_pct        float64  %       what the parameters make of it: the loss rate (a
                                                model's stationary one) x (1 - duplication)
    lost_flagged               boolean  -       configured_lost_pct outside the interval (on tbf:
                                                above it, netem's drops counting its full queue's);
                                                empty: not judged (correlated draws, later hops'
                                                counts, tbf beside duplication)
    duplicated                 Int64    -       frames sent twice (empty on tbf: netem counts none)
    duplicated_pct             float64  %       duplicated / frames
    duplicated_low_pct         float64  %       its 99% Wilson interval, low end
    duplicated_high_pct        float64  %       high end
    configured_duplicated_pct  float64  %       duplication x (1 - loss)^2 (a duplicate has its own
                                                loss draw)
    duplicated_flagged         boolean  -       configured_duplicated_pct outside the interval
    reordered                  Int64    -       copies sent ahead of the delayed ones
    reordered_pct              float64  %       reordered / frames_sent
    reordered_low_pct          float64  %       its 99% Wilson interval, low end
    reordered_high_pct         float64  %       high end
    configured_reordered_pct   float64  %       reordering r with gap g: r / (1 + (g - 1) r)
    reordered_flagged          boolean  -       configured_reordered_pct outside the interval
    drops                      Int64    -       frames a full queue of the port dropped
    stalls                     Int64    -       the machine's stalls of the port in the session
                                                (frames more than 1 ms late)
    stalled_ms                 float64  ms      their length in all
    flagged                    boolean  -       the rate, a delay or a count outside its interval
    outside                    string   -       what is outside its interval, in words (the line a
                                                run prints)
    note                       string   -       what was not judged, and why
"""
)

TRIAL_NAMES = [c.name for c in TRIAL_COLUMNS]
LAYER_NAMES = [c.name for c in LAYER_COLUMNS]
FIDELITY_NAMES = [c.name for c in FIDELITY_COLUMNS]


def markdown(columns: list[Column]) -> str:
    """The columns as a Markdown table (what results/README.md shows)."""
    lines = ["| column | type | unit | meaning |", "|---|---|---|---|"]
    for column in columns:
        lines.append(f"| `{column.name}` | {column.dtype} | {column.unit} | {column.meaning} |")
    return "\n".join(lines)


def readme_tables() -> str:
    return (
        "### `trials`: one row per device per repetition\n\n"
        + markdown(TRIAL_COLUMNS)
        + "\n\n### `layers`: one row per device per block per repetition\n\n"
        + "Per block, the timing and volume columns above mean the same for the block's "
        "message; marks are ms from the device's inference start.\n\n"
        + markdown(LAYER_COLUMNS)
        + "\n\n### `fidelity`: one row per session, device and direction\n\n"
        + "`fidelity.csv` and `fidelity.json` (docs/user-guide.md, The fidelity report): each "
        "link's configured rate, delay and impairments against what it achieved.\n\n"
        + markdown(FIDELITY_COLUMNS)
        + "\n"
    )


if __name__ == "__main__":
    sys.stdout.write(readme_tables())
