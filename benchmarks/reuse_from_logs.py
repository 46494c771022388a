"""Image-token hit rate of sgl_mmkv sides, read back from their server logs.

    python benchmarks/reuse_from_logs.py --tokens-per-image 256 --images 3 --requests 12 \
        benchmarks/results/pressure-holes/server-*.log

A server started with ``--mm-report-reuse`` logs one line per reusing request
(``sgl_mmkv: rid=... {...}``). Summing its ``reused_tokens`` and ``hole_tokens``
over a run whose measured requests are the only reusing ones (the pool warm-up
reads each page once) gives the share of the measured requests' image tokens that
the segment store served. For a run stopped before it wrote ``throughput.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

REUSE_LINE = re.compile(r"sgl_mmkv: rid=\S+ (\{.*\})")


def reuse_totals(log: Path) -> dict[str, int]:
    """Reusing requests and their reused / hole tokens in one server log."""
    totals = {"reusing_requests": 0, "reused_tokens": 0, "hole_tokens": 0}
    for line in log.read_text(errors="replace").splitlines():
        match = REUSE_LINE.search(line)
        if match:
            info = ast.literal_eval(match.group(1))
            totals["reusing_requests"] += 1
            totals["reused_tokens"] += int(info["reused_tokens"])
            totals["hole_tokens"] += int(info.get("hole_tokens", 0))
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--tokens-per-image", type=int, required=True)
    parser.add_argument("--images", type=int, required=True, help="images per measured request")
    parser.add_argument("--requests", type=int, required=True, help="measured requests")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    image_tokens = args.tokens_per_image * args.images * args.requests
    rows = []
    print("| side log | reusing requests | reused | holes | image-token hit rate |")
    print("|---|---|---|---|---|")
    for log in args.logs:
        totals = reuse_totals(log)
        rate = (totals["reused_tokens"] + totals["hole_tokens"]) / image_tokens
        rows.append({"log": log.name, **totals, "image_tokens": image_tokens, "hit_rate": rate})
        print(
            f"| {log.name} | {totals['reusing_requests']} | {totals['reused_tokens']} "
            f"| {totals['hole_tokens']} | {rate:.3f} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
