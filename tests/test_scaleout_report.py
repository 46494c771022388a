"""benchmarks/scaleout_mooncake.py without servers: a request sent again after a
failure, one lost after its retries, the summary and the table."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import scaleout_mooncake  # noqa: E402


def test_a_failed_request_is_sent_again_and_counted_lost_only_after_its_retries(monkeypatch):
    calls = []

    def flaky(url, messages):
        calls.append(url)
        if len(calls) == 1:
            raise RuntimeError("the stream ended early")
        return 120.0

    monkeypatch.setattr(scaleout_mooncake, "stream_ttft_ms", flaky)
    assert scaleout_mooncake._send("u", [], retries=1) == {
        "ttft_ms": 120.0,
        "errors": ["the stream ended early"],
    }

    def down(url, messages):
        raise ConnectionError("refused")

    monkeypatch.setattr(scaleout_mooncake, "stream_ttft_ms", down)
    lost = scaleout_mooncake._send("u", [], retries=2)
    assert lost == {"ttft_ms": None, "errors": ["refused"] * 3}
    summary = scaleout_mooncake._summary(
        [{"ttft_ms": 100.0, "errors": []}, {"ttft_ms": 300.0, "errors": ["x"]}, lost]
    )
    assert summary == {
        "requests": 3,
        "answered": 2,
        "lost": 1,
        "sent_again": 1,
        "mean_ttft_ms": 200.0,
        "p99_ttft_ms": 300.0,
    }


def test_the_table_has_a_row_per_configuration():
    query = {"mean_ttft_ms": 1000.0, "p99_ttft_ms": 2000.0, "answered": 24, "requests": 24}
    result = {"hit_rate": 0.75, "query": {**query, "sent_again": 1}, "counters": {"loaded": 6.0}}
    report = {
        "script": "s",
        "server": "v",
        "mooncake_extra": "m",
        "router": "r",
        "machine": "x",
        "results": {"two + Mooncake": result},
    }
    table = scaleout_mooncake.markdown(report)
    assert "| two + Mooncake | 0.750 | 1000 | 2000 | 24 / 24 | 1 | 6 |" in table
