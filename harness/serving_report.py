"""``benchmarks/bench_serving.py``'s mixed-traffic summary and its two plots.

A mixed cell is one trace (a mix of doc-QA, new-image and text-only requests, see
:mod:`harness.mixed_traces`) at one load: closed loop at a fixed concurrency
(``c4``) or Poisson arrivals (``rate0.5``: requests per second). Per side, over
the rounds: request and output-token throughput (mean of the rounds), TTFT and
inter-token latency percentiles over every request (and TTFT per kind), and for a
sgl_mmkv side the ratios to stock and the trace's FLOPs bound.

The FLOPs bound of a trace is the speedup it would get if every request cost its
prefill FLOPs: what stock's extends would have computed over what sgl_mmkv's passes
computed (the scheduler's ``full_prefill_flops`` and ``executed_flops`` counters,
read before and after the trace), as for the doc-QA bound in docs/performance.md.
Decode and the vision encoder are not in it.

With ``--profile-rate`` each side's scheduler is sampled over the trace
(:mod:`harness.scheduler_profile`), and a mode's row also has the trace's **time
bound**: stock's wall time per request with only its extend forward shrunk to the
mode's FLOPs fraction (decode, the vision encoder, the scheduler's own work and the
HTTP process kept as stock spent them), over stock's wall time. It is the FLOPs bound
with what the FLOPs bound leaves out measured instead of ignored.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from harness.mixed_traces import KINDS
from harness.report import percentile
from harness.scheduler_profile import PARTS
from harness.servers import STOCK


def flops_delta(before: dict, after: dict) -> dict[str, int]:
    """``{"full", "executed"}`` prefill FLOPs between two reads of a side's counters
    (:meth:`~harness.servers.Side.mmkv_stats`); empty for stock."""
    b, a = before.get("refresh", {}), after.get("refresh", {})
    if "full_prefill_flops" not in a:
        return {}
    return {
        "full": a["full_prefill_flops"] - b.get("full_prefill_flops", 0),
        "executed": a["executed_flops"] - b.get("executed_flops", 0),
    }


def per_request(result: dict, labels: list[dict]) -> list[dict]:
    """The client's per-request lists (``--output-details``, in trace order) with each
    request's kind: ``[{kind, images, ttft_ms, itl_ms, input_len, output_len, error}]``.
    Pops the lists from ``result``."""
    columns = [result.pop(k) for k in ("ttfts", "itls", "input_lens", "output_lens", "errors")]
    if any(len(c) != len(labels) for c in columns):
        raise ValueError(f"client reported {len(columns[0])} requests, trace has {len(labels)}")
    return [
        {
            "kind": label["kind"],
            "images": label["images"],
            "ttft_ms": 1e3 * ttft,
            "itl_ms": [1e3 * x for x in itl],
            "input_len": n_in,
            "output_len": n_out,
            "error": error,
        }
        for label, ttft, itl, n_in, n_out, error in zip(labels, *columns, strict=True)
    ]


def _side_row(records: list[dict]) -> dict:
    requests = [q for r in records for q in r["requests"]]
    ttft = [q["ttft_ms"] for q in requests]
    itl = [x for q in requests for x in q["itl_ms"]]
    rounds = sorted(records, key=lambda r: r["round"])
    row = {
        "mix": records[0]["mix"],
        "load": records[0]["load"],
        "side": records[0]["side"],
        "rounds": len(records),
        "completed": sum(r["result"]["completed"] for r in records),
        "failed": sum(bool(q["error"]) for q in requests),
        "request_throughput": statistics.fmean(r["result"]["request_throughput"] for r in rounds),
        "output_throughput": statistics.fmean(r["result"]["output_throughput"] for r in rounds),
        "round_request_throughput": [round(r["result"]["request_throughput"], 4) for r in rounds],
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "count_by_kind": {k: sum(q["kind"] == k for q in requests) for k in KINDS},
        "ttft_p50_by_kind_ms": {k: _p50([q for q in requests if q["kind"] == k]) for k in KINDS},
        "load_average": [r.get("load_average") for r in rounds],
    }
    flops = [r["flops"] for r in records if r.get("flops")]
    if flops:
        executed = sum(f["executed"] for f in flops)
        row["flops_bound"] = sum(f["full"] for f in flops) / executed if executed else 1.0
    if all("profile" in r for r in records) and row["completed"]:
        row["seconds_per_request"] = _seconds_per_request(records, row["completed"])
    return row


def _seconds_per_request(records: list[dict], completed: int) -> dict[str, float]:
    """Per completed request: the wall time (the client's duration), the sampler's
    ``window`` (longer: py-spy attaches and the client starts before the first
    request), and each sampled part. No forward runs outside the client's duration,
    so ``decode``, ``vision`` and ``extend`` are the trace's; ``scheduler`` holds the
    loop's polling over the whole window too."""
    total = dict.fromkeys(("wall", "window", *PARTS, "http"), 0.0)
    for r in records:
        total["wall"] += r["result"]["duration"]
        total["window"] += r["profile"]["wall_s"]
        for part in PARTS:
            total[part] += r["profile"]["scheduler_s"][part]
        total["http"] += r["profile"]["http_busy_s"]
    return {k: round(v / completed, 4) for k, v in total.items()}


def time_bound(stock: dict[str, float], flops_fraction: float) -> float:
    """Stock's wall time per request over the same with its extend forward scaled by
    ``flops_fraction`` (``stock``: :func:`_seconds_per_request`'s dict)."""
    kept = stock["wall"] - stock["extend"] * (1.0 - flops_fraction)
    return stock["wall"] / kept


def _p50(requests: list[dict]) -> float | None:
    """Median TTFT (ms) of ``requests``; None for none (a kind the mix leaves out)."""
    return percentile([q["ttft_ms"] for q in requests], 50) if requests else None


def summarise_mixed(records: list[dict], modes: Sequence[str]) -> list[dict]:
    """One row per mix, load and side (rounds pooled); a mode's row also has its
    ratios to stock's row and its share of the FLOPs bound."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for record in records:
        groups.setdefault((record["mix"], record["load"], record["side"]), []).append(record)
    rows = []
    for mix, load in dict.fromkeys((m, lo) for m, lo, _ in groups):
        stock = groups.get((mix, load, STOCK))
        base = _side_row(stock) if stock else None
        if base is not None:
            rows.append(base)
        for mode in modes:
            if (mix, load, mode) not in groups:
                continue
            row = _side_row(groups[(mix, load, mode)])
            if base is not None:
                _compare(row, base, stock, groups[(mix, load, mode)])
            rows.append(row)
    return rows


def _compare(row: dict, base: dict, stock: list[dict], ours: list[dict]) -> None:
    ratio = row["request_throughput"] / base["request_throughput"]
    stock_rounds = {r["round"]: r["result"]["request_throughput"] for r in stock}
    paired = [
        o["result"]["request_throughput"] / stock_rounds[o["round"]]
        for o in sorted(ours, key=lambda r: r["round"])
        if o["round"] in stock_rounds
    ]
    row["throughput_ratio"] = ratio
    row["throughput_ratio_range"] = [min(paired), max(paired)] if paired else []
    row["output_throughput_ratio"] = row["output_throughput"] / base["output_throughput"]
    row["p99_ttft_speedup"] = base["ttft_p99_ms"] / row["ttft_p99_ms"]
    row["itl_p50_vs_stock"] = row["itl_p50_ms"] / base["itl_p50_ms"]
    if not row["load"].startswith("c"):
        return  # at a request rate the arrivals set the throughput: no share of a bound
    if "flops_bound" in row:
        row["share_of_bound"] = ratio / row["flops_bound"]
    spent, stock_spent = row.get("seconds_per_request"), base.get("seconds_per_request")
    if "flops_bound" in row and spent and stock_spent:
        fraction = 1.0 / row["flops_bound"]
        row["time_bound"] = time_bound(stock_spent, fraction)
        row["share_of_time_bound"] = ratio / row["time_bound"]
        if stock_spent["extend"]:
            row["extend_over_flops_share"] = spent["extend"] / (fraction * stock_spent["extend"])


def format_mixed(rows: list[dict]) -> str:
    """Markdown: one line per mix, load and side."""
    lines = [
        "| mix | load | side | ok | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| TTFT p50 by kind (doc / new / text) ms | req/s vs stock (rounds) | p99 TTFT speedup "
        "| FLOPs bound | share of bound | ITL p50 vs stock |",
        "|" + "---|" * 14,
    ]
    for r in rows:
        by_kind = r["ttft_p50_by_kind_ms"]
        kinds = " / ".join("-" if by_kind[k] is None else f"{by_kind[k]:,.0f}" for k in KINDS)
        rng = r.get("throughput_ratio_range") or []
        vs = f"{r['throughput_ratio']:.2f}x" if "throughput_ratio" in r else ""
        vs += f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng else ""
        lines.append(
            f"| {r['mix']} | {r['load']} | {r['side']} | {r['completed']} "
            f"| {r['request_throughput']:.3f} | {r['output_throughput']:.2f} "
            f"| {r['ttft_p50_ms']:,.0f} / {r['ttft_p99_ms']:,.0f} "
            f"| {r['itl_p50_ms']:,.0f} / {r['itl_p99_ms']:,.0f} | {kinds} | {vs} "
            f"| {_fmt(r, 'p99_ttft_speedup', '{:.2f}x')} | {_fmt(r, 'flops_bound', '{:.2f}x')} "
            f"| {_fmt(r, 'share_of_bound', '{:.2f}')} | {_fmt(r, 'itl_p50_vs_stock', '{:.3f}')} |"
        )
    return "\n".join(lines)


def format_time_split(rows: list[dict]) -> str:
    """Markdown: per profiled mix, load and side, the seconds per request of the wall
    and of each sampled part, and a mode's time bound, its share, and its extend time
    over its FLOPs share of stock's; empty if nothing was profiled."""
    rows = [r for r in rows if "seconds_per_request" in r]
    if not rows:
        return ""
    parts = ("wall", "window", *PARTS, "http")
    lines = [
        "| mix | load | side | "
        + " | ".join(f"{p} s/req" for p in parts)
        + " | time bound | share of time bound | extend / FLOPs share |",
        "|" + "---|" * (len(parts) + 6),
    ]
    for r in rows:
        spent = r["seconds_per_request"]
        lines.append(
            f"| {r['mix']} | {r['load']} | {r['side']} | "
            + " | ".join(f"{spent[p]:.3f}" for p in parts)
            + f" | {_fmt(r, 'time_bound', '{:.2f}x')} | {_fmt(r, 'share_of_time_bound', '{:.2f}')}"
            f" | {_fmt(r, 'extend_over_flops_share', '{:.2f}')} |"
        )
    return "\n".join(lines)


def _fmt(row: dict, key: str, fmt: str) -> str:
    return fmt.format(row[key]) if key in row else ""


def ttft_by_pages(records: list[dict], modes: Sequence[str]) -> dict[str, list[tuple]]:
    """Doc-QA cells at concurrency 1: per side ``[(pages, mean TTFT ms)]`` (mean of the
    round means), and per mode ``"<mode> bound"``: stock's TTFT times the mode's FLOPs
    fraction of that cell."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        label = r["label"]
        if label.startswith("doc_qa-") and r["concurrency"] == 1 and "mix" not in r:
            pages = int(label.removeprefix("doc_qa-").removesuffix("img"))
            cells.setdefault((r["side"], pages), []).append(r)
    out: dict[str, list[tuple]] = {}
    for (side, pages), runs in sorted(cells.items()):
        out.setdefault(side, []).append(
            (pages, statistics.fmean(r["result"]["mean_ttft_ms"] for r in runs))
        )
    stock = dict(out.get(STOCK, []))
    for mode in modes:
        for (side, pages), runs in sorted(cells.items()):
            flops = [r["flops"] for r in runs if side == mode and r.get("flops")]
            full = sum(f["full"] for f in flops)
            if full and pages in stock:
                fraction = sum(f["executed"] for f in flops) / full
                out.setdefault(f"{mode} bound", []).append((pages, stock[pages] * fraction))
    return out


def throughput_by_concurrency(rows: list[dict]) -> dict[str, list[tuple]]:
    """Closed-loop mixed rows: per ``"<side>, <mix>"`` ``[(concurrency, req/s)]``, and
    per mode and mix ``"<mode> bound, <mix>"``: stock's req/s times the FLOPs bound."""
    out: dict[str, list[tuple]] = {}
    stock = {(r["mix"], r["load"]): r for r in rows if r["side"] == STOCK}
    for r in rows:
        if not r["load"].startswith("c"):
            continue
        c = int(r["load"][1:])
        out.setdefault(f"{r['side']}, {r['mix']}", []).append((c, r["request_throughput"]))
        base = stock.get((r["mix"], r["load"]))
        if r["side"] != STOCK and base is not None and "flops_bound" in r:
            bound = base["request_throughput"] * r["flops_bound"]
            out.setdefault(f"{r['side']} bound, {r['mix']}", []).append((c, bound))
    return {k: sorted(v) for k, v in out.items()}


def plot(
    pages: dict[str, list[tuple]], concurrency: dict[str, list[tuple]], title: str, path: Path
) -> Path:
    """TTFT against pages (left) and request throughput against concurrency (right),
    bounds dotted, stock dashed; a panel without data says so. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    sides = list(dict.fromkeys(name.split(",")[0].removesuffix(" bound") for name in pages))
    sides += [s for s in (n.split(",")[0].removesuffix(" bound") for n in concurrency)]
    colour = {side: f"C{i}" for i, side in enumerate(dict.fromkeys([STOCK, *sides]))}
    for ax, series in ((left, pages), (right, concurrency)):
        mixes = list(dict.fromkeys(name.partition(", ")[2] for name in series))
        for name, points in sorted(series.items(), key=lambda kv: not kv[0].startswith(STOCK)):
            side, _, mix = name.partition(", ")
            bound = side.endswith(" bound")
            style = ":" if bound else "--" if side == STOCK else "-"
            xs, ys = zip(*points, strict=True)
            ax.plot(
                xs,
                ys,
                style,
                color=colour[side.removesuffix(" bound")],
                marker="" if bound else "os^v"[mixes.index(mix) % 4],
                label=name,
            )
            ax.set_xticks(sorted({x for s in series.values() for x, _ in s}))
        if not series:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", transform=ax.transAxes)
        else:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    left.set(
        xlabel="pages per request",
        ylabel="mean TTFT (ms)",
        title="doc-QA, concurrency 1",
    )
    if pages:
        left.set_yscale("log")
        left.set_xscale("log", base=2)
        left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    right.set(xlabel="concurrency (closed loop)", ylabel="requests / s", title="mixed traffic")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
