"""The figures of a run directory, as PNG files readable without the code.

Every figure lists the method variants in one order and draws each in one colour and marker
(`common`); measured values are medians over repetitions with 95% intervals of the median, and
every figure states n.

- `latency`: latency.png (where a device's time goes, per rate: the paper's Fig. 5 kind) and
  compression.png (payload bits against Voltage's: Fig. 7);
- `rates`: effective_vs_bandwidth.png, comm_vs_bandwidth.png (Fig. 6) and
  measured_vs_analytic.png;
- `trace`: trace.png, for a run over a replayed bandwidth trace;
- `impairments`: effective_vs_delay.png and tail_by_link.png, for a run that swept
  impairments (`link.impairments`);
- `timeline`: timeline.png, for a run with device events (`timeline`).
"""

from __future__ import annotations

from pathlib import Path

from testbed.figures.impairments import effective_vs_delay, tail_by_link
from testbed.figures.latency import compression, latency_breakdown
from testbed.figures.rates import comm_vs_bandwidth, effective_vs_bandwidth, measured_vs_analytic
from testbed.figures.timeline import timeline_figure
from testbed.figures.trace import trace_timeline
from testbed.results.store import Results


def make_figures(results: Results) -> list[Path]:
    """Every figure of the run into its figures/ directory; returns the files written."""
    directory = results.run_dir / "figures"
    made = [
        latency_breakdown(results, directory / "latency.png"),
        effective_vs_bandwidth(results, directory / "effective_vs_bandwidth.png"),
        comm_vs_bandwidth(results, directory / "comm_vs_bandwidth.png"),
        measured_vs_analytic(results, directory / "measured_vs_analytic.png"),
        compression(results, directory / "compression.png"),
        trace_timeline(results, directory / "trace.png"),
        effective_vs_delay(results, directory / "effective_vs_delay.png"),
        tail_by_link(results, directory / "tail_by_link.png"),
        timeline_figure(results, directory / "timeline.png"),
    ]
    return [p for p in made if p is not None]
