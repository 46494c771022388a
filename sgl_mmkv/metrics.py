"""sgl_mmkv's server-wide counters as Prometheus gauges, next to SGLang's own metrics.

With ``--enable-metrics`` SGLang serves ``/metrics`` from a multiprocess registry
(``PROMETHEUS_MULTIPROC_DIR``, inherited by the scheduler). Each counter of each
group becomes one gauge ``sglang:mmkv_<group>_<counter>`` (for example
``sglang:mmkv_store_hits``), set from the scheduler after every extend forward.
The metrics are the operator's view: they reach callers only through ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Mapping

PREFIX = "sglang:mmkv_"


def metrics_enabled() -> bool:
    """Whether this SGLang server runs with ``--enable-metrics``."""
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except Exception:  # no runtime context (unit tests): no metrics
        return False


class MMKVMetrics:
    """Gauges created on first publish, one per (group, counter)."""

    def __init__(self) -> None:
        self._gauges: dict[str, object] = {}

    def publish(self, groups: Mapping[str, Mapping[str, int | float]]) -> None:
        """Set every numeric counter of ``groups`` (``{group: {counter: value}}``)."""
        from prometheus_client import Gauge

        for group, counters in groups.items():
            for counter, value in counters.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
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
