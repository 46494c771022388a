"""The benchmark and demo harness (not installed; run from the repository root, e.g.
``python -m harness.demo``): throughput against stock SGLang (workloads, client,
runner, report, SGLang's own client), fidelity against full prefill (the synthetic
task, its client, summaries, paired intervals, CONDUIT ablations) and the demo. It
imports sgl_mmkv; sgl_mmkv never imports it."""
