"""Run SGLang's own benchmark client, ``python -m sglang.benchmark.serving``, and read
its result.

Each call is one client process against one running server: an ``openai`` JSONL
trace (:mod:`harness.traces`) or SGLang's ``random-ids`` text
dataset (no download), streaming chat completions, no warm-up request (its
warm-up would send the trace's first request twice, a prefix hit on every side).
The client appends one JSON record per run to ``--output-file``; that record is
returned as a dict (``mean_ttft_ms``, ``output_throughput``, ``completed``, ...).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CLIENT_MODULE = "sglang.benchmark.serving"


@dataclass(frozen=True, slots=True)
class ClientRun:
    """One client invocation: what it sends and at which concurrency."""

    label: str
    concurrency: int
    num_prompts: int
    trace: Path | None = None  # an ``openai`` JSONL trace; None: random text
    text_input_len: int = 512
    text_output_len: int = 64
    request_rate: float | None = None  # Poisson arrivals (req/s); None: closed loop
    details: bool = False  # per-request TTFT, ITLs, lengths and errors in the record

    def dataset_args(self) -> list[str]:
        if self.trace is not None:
            return ["--dataset-name", "openai", "--dataset-path", str(self.trace)]
        return [
            "--dataset-name",
            "random-ids",
            "--random-input-len",
            str(self.text_input_len),
            "--random-output-len",
            str(self.text_output_len),
            "--random-range-ratio",
            "1.0",
        ]


def client_command(base_url: str, model: Path, run: ClientRun, output_file: Path) -> list[str]:
    """The ``sglang.benchmark.serving`` command line of ``run`` against ``base_url``."""
    return [
        sys.executable,
        "-m",
        CLIENT_MODULE,
        "--backend",
        "sglang-oai-chat",
        "--base-url",
        base_url,
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        *run.dataset_args(),
        "--num-prompts",
        str(run.num_prompts),
        "--max-concurrency",
        str(run.concurrency),
        *(["--request-rate", f"{run.request_rate:g}"] if run.request_rate else []),
        *(["--output-details"] if run.details else []),
        "--warmup-requests",
        "0",
        "--seed",
        "0",
        "--disable-tqdm",
        "--output-file",
        str(output_file),
    ]


def run_client(
    base_url: str, model: Path, run: ClientRun, out_dir: Path, timeout_s: float = 3600
) -> dict:
    """Run the client once; returns its result record. Raises ``RuntimeError`` with the
    tail of its output if it fails or reports fewer completed requests than sent."""
    out_dir.mkdir(parents=True, exist_ok=True)
    output_file = out_dir / f"{run.label}-c{run.concurrency}.jsonl"
    output_file.unlink(missing_ok=True)
    command = client_command(base_url, model, run, output_file)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    log = out_dir / f"{run.label}-c{run.concurrency}.log"
    log.write_text(f"$ {shlex.join(command)}\n{done.stdout}\n{done.stderr}")
    if done.returncode != 0 or not output_file.exists():
        tail = (done.stdout + done.stderr)[-1500:]
        raise RuntimeError(f"{CLIENT_MODULE} exited {done.returncode} ({log}):\n{tail}")
    record = json.loads(output_file.read_text().strip().splitlines()[-1])
    record.pop("server_info", None)  # 40 kB per run; settings are compared from the servers
    record.pop("generated_texts", None)
    if record.get("completed") != run.num_prompts:
        raise RuntimeError(
            f"{CLIENT_MODULE}: {record.get('completed')} of {run.num_prompts} requests completed"
        )
    return record
