"""Benchmark harnesses: throughput against stock SGLang (workloads, client, runner,
report) and fidelity against full prefill (the synthetic task and its client)."""
