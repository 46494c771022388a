"""Summaries of fidelity probes: per (mode, scenario) accuracy with 95 % paired
bootstrap intervals, agreement and KL; the table and JSON the benchmark writes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.bootstrap import paired_intervals
from harness.fidelity import ProbeRecord


@dataclass(slots=True)
class ScenarioSummary:
    mode: str
    budget: float | str | None  # a fraction, "auto", or None (unbudgeted)
    scenario: str
    n: int
    full_prefill_accuracy: float
    accuracy: float
    relative_accuracy: float
    first_token_agreement: float
    reply_agreement: float  # the probe's whole reply equals the reference's
    mean_first_token_kl: float
    mean_prompt_tokens: float
    mean_cached_tokens: float
    mean_cached_image_tokens: float
    mean_reused_tokens: float
    mean_refreshed_tokens: float
    mean_probe_latency_s: float
    mean_flops_fraction: float  # executed / full-prefill FLOPs of the probes' extends
    per_qtype_accuracy: dict[str, float] = field(default_factory=dict)
    # 95 % paired bootstrap intervals (:func:`~harness.bootstrap.paired_intervals`)
    accuracy_ci: tuple[float, float] = (float("nan"), float("nan"))
    relative_accuracy_ci: tuple[float, float] = (float("nan"), float("nan"))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarise(
    mode: str, records: list[ProbeRecord], budget: float | None = None
) -> list[ScenarioSummary]:
    summaries = []
    for scenario in dict.fromkeys(r.scenario for r in records):
        rs = [r for r in records if r.scenario == scenario]
        full = _mean([float(r.reference_correct) for r in rs])
        acc = _mean([float(r.probe_correct) for r in rs])
        qtypes = sorted({r.qtype for r in rs})
        intervals = paired_intervals(
            [float(r.reference_correct) for r in rs], [float(r.probe_correct) for r in rs]
        )
        summaries.append(
            ScenarioSummary(
                mode=mode,
                budget=budget,
                scenario=scenario,
                n=len(rs),
                full_prefill_accuracy=full,
                accuracy=acc,
                relative_accuracy=acc / full if full > 0 else float("nan"),
                first_token_agreement=_mean([float(r.first_token_agree) for r in rs]),
                reply_agreement=_mean([float(r.probe == r.reference) for r in rs]),
                mean_first_token_kl=_mean([r.first_token_kl for r in rs]),
                mean_prompt_tokens=_mean([r.prompt_tokens for r in rs]),
                mean_cached_tokens=_mean([r.probe_cached_tokens for r in rs]),
                mean_cached_image_tokens=_mean([r.probe_cached_image_tokens for r in rs]),
                mean_reused_tokens=_mean([r.probe_reused_tokens for r in rs]),
                mean_refreshed_tokens=_mean([r.probe_refreshed_tokens for r in rs]),
                mean_probe_latency_s=_mean([r.probe_latency_s for r in rs]),
                mean_flops_fraction=_mean([r.probe_flops_fraction for r in rs]),
                per_qtype_accuracy={
                    q: _mean([float(r.probe_correct) for r in rs if r.qtype == q]) for q in qtypes
                },
                accuracy_ci=intervals["accuracy"],
                relative_accuracy_ci=intervals["relative_accuracy"],
            )
        )
    return summaries


def format_table(summaries: list[ScenarioSummary]) -> str:
    header = (
        f"{'mode':<13} {'budget':>6} {'scenario':<15} {'n':>4} {'full acc':>8} {'acc':>6} "
        f"{'acc 95% CI':>13} {'rel acc':>7} {'rel 95% CI':>13} {'1st agree':>9} "
        f"{'reply agree':>11} {'KL':>8} {'prompt':>7} "
        f"{'cached':>7} "
        f"{'img cached':>10} {'reused':>7} {'refreshed':>9} {'FLOPs':>6} {'latency s':>9}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        budget = (
            "-" if s.budget is None else s.budget if isinstance(s.budget, str) else f"{s.budget:g}"
        )
        lines.append(
            f"{s.mode:<13} {budget:>6} {s.scenario:<15} {s.n:>4} {s.full_prefill_accuracy:>8.3f} "
            f"{s.accuracy:>6.3f} {_interval(s.accuracy_ci):>13} {s.relative_accuracy:>7.3f} "
            f"{_interval(s.relative_accuracy_ci):>13} {s.first_token_agreement:>9.3f} "
            f"{s.reply_agreement:>11.3f} {s.mean_first_token_kl:>8.4f} "
            f"{s.mean_prompt_tokens:>7.1f} {s.mean_cached_tokens:>7.1f} "
            f"{s.mean_cached_image_tokens:>10.1f} "
            f"{s.mean_reused_tokens:>7.1f} {s.mean_refreshed_tokens:>9.1f} "
            f"{s.mean_flops_fraction:>6.3f} {s.mean_probe_latency_s:>9.3f}"
        )
    return "\n".join(lines)


def _interval(bounds: tuple[float, float]) -> str:
    return f"[{bounds[0]:.3f},{bounds[1]:.3f}]"


def to_json(summaries: list[ScenarioSummary], records: dict[str, list[ProbeRecord]]) -> dict:
    return {
        "summaries": [asdict(s) for s in summaries],
        "records": {mode: [asdict(r) for r in rs] for mode, rs in records.items()},
    }
