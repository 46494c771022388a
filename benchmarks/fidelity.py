"""Fidelity benchmark: reuse modes against full prefill, through real servers.

    python benchmarks/fidelity.py \
        --modes stock,exact,reuse,full,conduit,prophetkv,first,cacheblend,random

For each mode a server is started (``stock``: ``python -m sglang.launch_server``;
otherwise ``python -m sgl_mmkv.launch_server --mm-reuse MODE``) with the same CPU
settings, the test split is run through every scenario (see
``harness.fidelity``), and the server is stopped. Prints a table,
writes ``fidelity.json`` and ``fidelity.png`` (relative accuracy against refresh
budget, one line per method, full prefill dashed) into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

from harness.conduit_ablations import (
    ablation_knobs,
    ablation_label,
    scorer_args,
)
from harness.fidelity import (
    COLD,
    SCENARIOS,
    FidelityClient,
    PromptLayout,
    ReferenceReplies,
    measure,
)
from harness.fidelity_summary import ScenarioSummary, format_table, summarise, to_json
from harness.fidelity_task import fidelity_pool_tokens, model_split
from sgl_mmkv.config import ADAPTIVE_SCORERS, CACHE_ONLY_MODES, SEGMENT_FILL_POLICIES
from sgl_mmkv.cpu_support import prepare_cpu_process
from sgl_mmkv.scoring import AUTO_BUDGET, REFRESH_SCORERS
from sgl_mmkv.testing.server import REPORT_REUSE, ServerProcess, cpu_server_args, mmkv_stats

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "fidelity-qwen2-vl-marked"
# Scorer modes run at every --budgets value (every registered refresh scorer, the
# `oracle` yardstick included); `reuse` (budget 0) and `full` (every token
# refreshed) are each one configuration, drawn as the ends of every line.
UNBUDGETED_REFRESH: dict[str, float] = {"reuse": 0.0, "full": 1.0}
BUDGETED_MODES: tuple[str, ...] = tuple(m for m in REFRESH_SCORERS if m not in UNBUDGETED_REFRESH)
# A method is measured on every probe, also where the server's default cost gate
# would serve the probe as stock does (a short probe reusing one small image).
MEASURE_EVERY_MATCH: tuple[str, ...] = ("--mm-reuse-gate", "always")


def eviction_server_for(
    evict: str,
    kv_budget: float,
    model: Path,
    log_dir: Path,
    refresh_budget: float,
    pool_tokens: int = 4096,
) -> ServerProcess:
    """A ``conduit`` server whose segments are compressed to ``kv_budget`` as soon
    as they are stored: every probe reuses compressed segments."""
    extra = [
        *("--mm-reuse", "conduit", "--mm-refresh-budget", str(refresh_budget)),
        *MEASURE_EVERY_MATCH,
        *("--mm-evict", evict, "--mm-kv-budget", str(kv_budget), "--mm-compress-at", "fill"),
    ]
    return mmkv_server(extra, model, log_dir / f"evict_{evict}_{kv_budget}.log", pool_tokens)


def decode_compression_server_for(
    evict: str, kv_budget: float, model: Path, log_dir: Path, pool_tokens: int = 4096
) -> ServerProcess:
    """A ``conduit`` server whose running requests decode from their rows' top
    ``kv_budget`` image tokens (``--mm-compress-at decode``)."""
    extra = [
        *("--mm-reuse", "conduit"),
        *("--mm-evict", evict, "--mm-kv-budget", str(kv_budget), "--mm-compress-at", "decode"),
    ]
    return mmkv_server(extra, model, log_dir / f"decode_{evict}_{kv_budget}.log", pool_tokens)


def server_for(
    mode: str,
    model: Path,
    budget: float | str | None,
    log_dir: Path,
    segment_fill: str = "first",
    ablation: str | None = None,
    knobs: str = "",
    pool_tokens: int = 4096,
) -> ServerProcess:
    """The server of ``mode`` at ``budget`` (a fraction or ``auto``); ``ablation``: a
    CONDUIT ablation's name (``mode`` is then ``conduit``, with that ablation's scorer
    knobs); ``knobs``: otherwise, the scorer's knobs as a JSON object; ``pool_tokens``:
    the KV pool (:func:`harness.fidelity_task.fidelity_pool_tokens`)."""
    if mode == "stock":
        return ServerProcess(
            "sglang.launch_server",
            model,
            cpu_server_args(pool_tokens),
            log_path=log_dir / "stock.log",
        )
    extra = ["--mm-reuse", mode]
    if budget is not None:
        extra += ["--mm-refresh-budget", str(budget)]
    if ablation is not None:
        extra += ["--mm-refresh-scorer-args", scorer_args(ablation)]
    elif knobs and mode in BUDGETED_MODES:
        extra += ["--mm-refresh-scorer-args", knobs]
    if mode not in CACHE_ONLY_MODES:
        extra += ["--mm-segment-fill", segment_fill, *MEASURE_EVERY_MATCH]
    name = ablation_label(ablation) if ablation is not None else mode
    name += f"_{budget}" if budget is not None else ""
    return mmkv_server(extra, model, log_dir / f"{name}.log", pool_tokens)


def budgets_of(mode: str, budgets: list[float | str]) -> list[float | str | None]:
    """The budgets ``mode`` runs at: every one for a budgeted mode (``auto`` only where
    its scorer sizes budgets), else its single configuration."""
    if mode not in BUDGETED_MODES:
        return [UNBUDGETED_REFRESH.get(mode)]
    adapts = mode in ADAPTIVE_SCORERS
    return [b for b in budgets if b != AUTO_BUDGET or adapts]


def mmkv_server(
    flags: list[str], model: Path, log_path: Path, pool_tokens: int = 4096
) -> ServerProcess:
    """``python -m sgl_mmkv.launch_server`` with ``flags`` and the CPU settings."""
    args = [*flags, REPORT_REUSE, *cpu_server_args(pool_tokens)]
    return ServerProcess("sgl_mmkv.launch_server", model, args, log_path=log_path)


def measure_on(
    server: ServerProcess, label: str, layout, examples, scenarios, references=None, concurrency=1
) -> tuple[list, dict]:
    """Start ``server``, run every probe through it, stop it; the probe records and
    the server's sgl_mmkv counters after them."""
    with server:
        client = FidelityClient(server.base_url)
        records = measure(client, layout, examples, scenarios, references, concurrency)
        stats = mmkv_stats(server.base_url)
    print(f"[fidelity] {label}: {len(records)} probes", flush=True)
    return records, stats


def machine_description() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}"


def _x(summary: ScenarioSummary) -> float:
    """Where a summary is drawn: its budget; at ``auto``, the share of reused image
    tokens it refreshed."""
    if summary.budget != AUTO_BUDGET:
        return summary.budget
    reused = summary.mean_reused_tokens
    return summary.mean_refreshed_tokens / reused if reused > 0 else 0.0


def plot(summaries: list[ScenarioSummary], budgets: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = [s for s in (*SCENARIOS, COLD) if any(x.scenario == s for x in summaries)]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4 * len(scenarios), 3.4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        rows = [s for s in summaries if s.scenario == scenario]
        ends = {s.mode: s for s in rows if s.mode in UNBUDGETED_REFRESH}
        for i, mode in enumerate(dict.fromkeys(s.mode for s in rows)):
            mine = [s for s in rows if s.mode == mode]
            refresh = mode not in UNBUDGETED_REFRESH and mine[0].budget is not None
            refresh = refresh and not mode.startswith(("kv:", "decode:"))
            if refresh or mode.startswith(("kv:", "decode:")):
                points = [(_x(s), s) for s in mine]
                if refresh:
                    points += [(UNBUDGETED_REFRESH[m], e) for m, e in ends.items()]
                points.sort(key=lambda point: point[0])
                xs = [x for x, _ in points]
                ys = [p.relative_accuracy for _, p in points]
                spread = [  # 95 % bootstrap interval around each point
                    [
                        max(0.0, y - p.relative_accuracy_ci[0])
                        for y, (_, p) in zip(ys, points, strict=True)
                    ],
                    [
                        max(0.0, p.relative_accuracy_ci[1] - y)
                        for y, (_, p) in zip(ys, points, strict=True)
                    ],
                ]
                style = "--" if mode.startswith(("kv:", "decode:")) else "-"
                ax.errorbar(
                    xs,
                    ys,
                    yerr=spread,
                    marker="o",
                    linestyle=style,
                    color=f"C{i}",
                    label=mode,
                    capsize=2,
                )
            elif mode not in UNBUDGETED_REFRESH:
                ax.axhline(mine[0].relative_accuracy, linestyle=":", color=f"C{i}", label=f"{mode}")
        ax.axhline(1.0, color="black", linestyle="--", label="full prefill")
        ax.set_title(scenario)
        ax.set_xlabel("refresh budget; kv:/decode: lines: kept fraction")
        ax.set_ylabel("accuracy / full-prefill accuracy (95 % CI)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.1)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--modes", default="stock,off,exact")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--num-examples", type=int, default=40)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="probes measured at once (their images differ; see fidelity.measure)",
    )
    parser.add_argument(
        "--budgets",
        default="0.05,0.1,0.2",
        help=f"for budgeted modes; {AUTO_BUDGET}: each request's own, for the modes that "
        f"size it ({', '.join(ADAPTIVE_SCORERS)})",
    )
    parser.add_argument(
        "--scorer-args",
        default="",
        help="JSON object of knobs for every budgeted mode's scorer (--mm-refresh-scorer-args)",
    )
    parser.add_argument(
        "--label", default="", help="appended to the budgeted modes' names (e.g. a knob setting)"
    )
    parser.add_argument(
        "--conduit-ablations",
        default="",
        help="CONDUIT with one part off, each at every --budgets value (e.g. no_value_norm,"
        "no_amplification,last_text,layers_0_1); labelled conduit-<name>",
    )
    parser.add_argument(
        "--segment-fill",
        choices=sorted(SEGMENT_FILL_POLICIES),
        default="first",
        help="--mm-segment-fill of the refresh-mode servers",
    )
    parser.add_argument(
        "--evict-modes",
        default="",
        help="eviction scorers (e.g. aircache,mmshiftkv,snapkv): a conduit server per scorer "
        "and --kv-budgets value whose segments are compressed when stored",
    )
    parser.add_argument(
        "--decode-evict-modes",
        default="",
        help="eviction scorers for decode-time compression: a server per scorer and "
        "--kv-budgets value, probed cold (scenario cold) against an uncompressed server",
    )
    parser.add_argument("--kv-budgets", default="0.05,0.1,0.2,0.5")
    parser.add_argument(
        "--evict-refresh-budget", type=float, default=0.1, help="refresh budget of those servers"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/fidelity"))
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the server
    prepare_cpu_process()
    modes = [m for m in args.modes.split(",") if m]
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    budgets = [b if b == AUTO_BUDGET else float(b) for b in args.budgets.split(",") if b]
    ablations = [a for a in args.conduit_ablations.split(",") if a]
    for name in ablations:
        try:
            ablation_knobs(name)
        except ValueError as exc:
            parser.error(str(exc))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    examples = model_split(args.model_path, "test", args.num_examples)
    layout = PromptLayout(str(args.model_path))
    pool = fidelity_pool_tokens(args.model_path, args.concurrency)

    summaries: list[ScenarioSummary] = []
    records = {}
    started = time.monotonic()
    for mode in modes:
        for budget in budgets_of(mode, budgets):
            name = mode + args.label if mode in BUDGETED_MODES else mode
            label = name if budget is None else f"{name}@{budget}"
            server = server_for(
                mode, args.model_path, budget, args.out_dir, args.segment_fill, None,
                args.scorer_args, pool,
            )  # fmt: skip
            records[label], _ = measure_on(
                server, label, layout, examples, scenarios, concurrency=args.concurrency
            )
            summaries += summarise(name, records[label], budget)
    for name in ablations:
        mode = ablation_label(name)
        for budget in budgets_of("conduit", budgets):
            label = f"{mode}@{budget}"
            server = server_for(
                "conduit",
                args.model_path,
                budget,
                args.out_dir,
                args.segment_fill,
                name,
                pool_tokens=pool,
            )
            records[label], _ = measure_on(
                server, label, layout, examples, scenarios, concurrency=args.concurrency
            )
            summaries += summarise(mode, records[label], budget)
    for evict in [m for m in args.evict_modes.split(",") if m]:
        for kv_budget in [float(b) for b in args.kv_budgets.split(",") if b]:
            label = f"evict:{evict}@{kv_budget}"
            server = eviction_server_for(
                evict, kv_budget, args.model_path, args.out_dir, args.evict_refresh_budget, pool
            )
            records[label], _ = measure_on(
                server, label, layout, examples, scenarios, concurrency=args.concurrency
            )
            summaries += summarise(f"kv:{evict}", records[label], kv_budget)
    decode_modes = [m for m in args.decode_evict_modes.split(",") if m]
    decode_counters: dict[str, dict] = {}  # label -> the server's counters after its probes
    if decode_modes:
        uncompressed = mmkv_server(
            ["--mm-reuse", "conduit"], args.model_path, args.out_dir / "decode_reference.log", pool
        )
        with uncompressed:
            references = ReferenceReplies(FidelityClient(uncompressed.base_url))
            for evict in decode_modes:
                for kv_budget in [float(b) for b in args.kv_budgets.split(",") if b]:
                    label = f"decode:{evict}@{kv_budget}"
                    server = decode_compression_server_for(
                        evict, kv_budget, args.model_path, args.out_dir, pool
                    )
                    records[label], stats = measure_on(
                        server, label, layout, examples, [COLD], references
                    )
                    decode_counters[label] = stats["row_compaction"]
                    print(f"[fidelity] {label}: {decode_counters[label]}", flush=True)
                    summaries += summarise(f"decode:{evict}", records[label], kv_budget)

    table = format_table(summaries)
    print(table)
    result = {
        "command": "python benchmarks/fidelity.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine_description(),
        "model_path": str(args.model_path),
        "num_examples": args.num_examples,
        "segment_fill": args.segment_fill,
        "evict_refresh_budget": args.evict_refresh_budget,
        "seconds": round(time.monotonic() - started, 1),
        "pool_tokens": pool,
        "decode_compression": decode_counters,
        **to_json(summaries, records),
    }
    (args.out_dir / "fidelity.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "fidelity.txt").write_text(table + "\n")
    plot(summaries, budgets, args.out_dir / "fidelity.png")
    print(f"[fidelity] wrote {args.out_dir}/fidelity.json, fidelity.txt, fidelity.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
