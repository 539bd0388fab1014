"""How long Ray keeps exporting a gauge that nobody sets again: why the supervisor's gauges are held.

A one-node local cluster with a metrics export port; an actor sets a
``ray.util.metrics.Gauge`` once (or, with ``--hold``, every 5 s through
``loomray.telemetry.HeldGauge`` and ``hold_gauges``, as the supervisor does);
the script scrapes ``/metrics`` every 2 s and prints when the series is there.

    python bench/ray_gauge_expiry.py          # set once: the series disappears
    python bench/ray_gauge_expiry.py --hold   # held: it stays
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loomray.runtime.connection import apply_ray_env_defaults  # noqa: E402

apply_ray_env_defaults()

import ray  # noqa: E402

from loomray.testing import free_port  # noqa: E402
from loomray.testing.cluster import local_cluster  # noqa: E402


@ray.remote(num_cpus=0)
class Reporter:
    """Sets one gauge, once or held."""

    async def report(self, hold: bool) -> bool:
        from ray.util.metrics import Gauge

        from loomray import telemetry

        gauge = Gauge("loomray_bench_gauge", "set once", tag_keys=("k",))
        if not hold:
            gauge.set(5, tags={"k": "a"})
            return True
        held = telemetry.HeldGauge(gauge)
        held.set(5, tags={"k": "a"})
        self.holding = held
        return True

    async def hold(self) -> None:
        """Set it again every 5 s, as ``telemetry.hold_gauges`` does in the supervisor."""
        while True:
            await asyncio.sleep(5.0)
            self.holding.again()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", action="store_true", help="set the gauge again every 5 s (as the supervisor)")
    parser.add_argument("--seconds", type=float, default=40.0, help="how long to watch the endpoint")
    args = parser.parse_args()
    port = free_port()
    with local_cluster(num_nodes=1, num_cpus_per_node=2, system_config={"metrics_report_interval_ms": 500},
                       head_node_args={"metrics_export_port": port}):
        reporter = Reporter.remote()
        ray.get(reporter.report.remote(args.hold))
        if args.hold:
            reporter.hold.remote()
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            there = any(line.startswith("ray_loomray_bench_gauge{") for line in text.splitlines())
            print(f"{time.monotonic() - start:5.1f} s  {'exported' if there else 'absent'}", flush=True)
            time.sleep(2)


if __name__ == "__main__":
    main()
