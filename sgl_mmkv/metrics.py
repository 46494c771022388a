"""sgl_mmkv's server-wide counters as Prometheus gauges, next to SGLang's own metrics.

With ``--enable-metrics`` SGLang serves ``/metrics`` from a multiprocess registry
(``PROMETHEUS_MULTIPROC_DIR``, inherited by the scheduler). A published counter of a
group becomes one gauge ``sglang:mmkv_<group>_<counter>`` (for example
``sglang:mmkv_segments_requests``), set from the scheduler after every match and
extend forward.

SGLang serves ``/metrics`` without authentication, even with ``--api-key``. So by
default only :data:`COARSE_COUNTERS` are published: counters that a request moves
by the same amount whether its images were reused or not. Every other counter
(store hits and fills, reused and refreshed tokens, storage hits, pool sizes, ...)
moves on a reuse and tells a reader that someone sent an image again; those are
published only with ``--mm-report-reuse``, like the other reuse facts.
"""

from __future__ import annotations

from collections.abc import Mapping

PREFIX = "sglang:mmkv_"
# {group: counters} published without --mm-report-reuse: request volume, and the
# failures of sgl_mmkv's own path (a health signal for the operator).
COARSE_COUNTERS: dict[str, frozenset[str]] = {
    "segments": frozenset({"requests", "image_items", "image_tokens"}),
    "refresh": frozenset({"fallbacks", "kernel_reference"}),
    "row_compaction": frozenset({"failures"}),
}


def metrics_enabled() -> bool:
    """Whether this SGLang server runs with ``--enable-metrics``."""
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except Exception:  # no runtime context (unit tests): no metrics
        return False


def published(
    groups: Mapping[str, Mapping[str, int | float]], report_reuse: bool
) -> dict[str, dict[str, int | float]]:
    """The numeric counters of ``groups`` that go to ``/metrics``: all of them with
    ``report_reuse``, else only :data:`COARSE_COUNTERS`."""
    out: dict[str, dict[str, int | float]] = {}
    for group, counters in groups.items():
        allowed = COARSE_COUNTERS.get(group, frozenset())
        kept = {
            name: value
            for name, value in counters.items()
            if isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (report_reuse or name in allowed)
        }
        if kept:
            out[group] = kept
    return out


class MMKVMetrics:
    """Gauges created on first publish, one per published (group, counter).

    Args:
        report_reuse: ``--mm-report-reuse``: publish every counter, not only the
            coarse ones.
    """

    def __init__(self, report_reuse: bool = False) -> None:
        self.report_reuse = report_reuse
        self._gauges: dict[str, object] = {}

    def publish(self, groups: Mapping[str, Mapping[str, int | float]]) -> None:
        """Set the published counters of ``groups`` (``{group: {counter: value}}``)."""
        from prometheus_client import Gauge

        for group, counters in published(groups, self.report_reuse).items():
            for counter, value in counters.items():
                name = f"{PREFIX}{group}_{counter}"
                gauge = self._gauges.get(name)
                if gauge is None:
                    gauge = Gauge(
                        name,
                        f"sgl_mmkv {group} counter {counter} since start",
                        multiprocess_mode="mostrecent",
                    )
                    self._gauges[name] = gauge
                gauge.set(value)
