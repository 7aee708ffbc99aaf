"""``/metrics`` in the Prometheus text format, as Toxiproxy's ``-proxy-metrics`` serves it.

Only the two proxy counters exist, labelled ``direction, listener, proxy, upstream``; like Toxiproxy,
a link adds its bytes when it ends (received when its source closes, sent when its destination closes
without a write error), so counters move once connections close. ``-runtime-metrics`` has no Go runtime
here: it serves this Python process's own collectors instead.
"""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal

Labels = tuple[str, str, str, str]  # direction, proxy, listener, upstream

RECEIVED = "toxiproxy_proxy_received_bytes_total"
SENT = "toxiproxy_proxy_sent_bytes_total"


def go_float(value: float) -> str:
    """Go's ``strconv.FormatFloat(v, 'g', -1, 64)``: exponent form from 1e+06 on."""
    if value == 0:
        return "0"
    sign, digits, exponent = Decimal(repr(float(value))).normalize().as_tuple()
    text = "".join(map(str, digits))
    exp = len(text) + int(exponent) - 1
    prefix = "-" if sign else ""
    if exp < -4 or exp >= 6:  # shortest 'g' switches at an exponent of 6
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{prefix}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    return prefix + format(Decimal(repr(float(value))).normalize(), "f")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ProxyMetrics:
    def __init__(self) -> None:
        self.counters: dict[str, dict[Labels, int]] = {RECEIVED: defaultdict(int), SENT: defaultdict(int)}

    def add(self, name: str, labels: Labels, count: int) -> None:
        self.counters[name][labels] += count

    def render(self) -> str:
        lines = []
        for name in sorted(self.counters):
            series = self.counters[name]
            if not series:
                continue  # Go's registry does not show a vector before its first child
            lines += [f"# HELP {name} ", f"# TYPE {name} counter"]
            for (direction, proxy, listener, upstream), value in sorted(series.items()):
                labels = (f'direction="{_escape(direction)}",listener="{_escape(listener)}",'
                          f'proxy="{_escape(proxy)}",upstream="{_escape(upstream)}"')
                lines.append(f"{name}{{{labels}}} {go_float(value)}")
        return "".join(line + "\n" for line in lines)


def runtime_metrics() -> str:
    """This process's CPU, memory, fds and GC, from prometheus_client's default collectors."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.gc_collector import GCCollector
    from prometheus_client.platform_collector import PlatformCollector
    from prometheus_client.process_collector import ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return generate_latest(registry).decode()
