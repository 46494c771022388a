"""Which tokens should stalepatch probe? Issue 50's follow-up to the no-go of H2.

``training/repair_study.py`` found that four probes spread over an image's grid do
not pin down the change of its other tokens (H2). This study keeps the one-pass
stalepatch (kernel form, P = 4, the configuration chosen there) and changes only
which tokens of each probed image are its probes:

- ``grid``: spread over the image's grid (repair_study's choice);
- ``salient-oracle``: the P tokens the target prompt's question reads most at full
  prefill (its rows after the last image, attention averaged over layers and
  heads). Not servable: the full prefill is what reuse avoids. It bounds what a
  better choice of probes can buy;
- ``salient-fill``: the P tokens the *warm-up* prompt's question read most. Servable:
  a fill could store it with the segment;
- ``salient-layer0``: the P tokens the target's question reads most at layer 0.
  Servable before the pass: at layer 0 an image's K is its embedding's (no
  context), and so are the question's queries;
- ``two-pass``: servable, two passes: the text and staleprobe's one-token probes
  over the stale row (its staleness ``z``, and the question's attention over the
  stale row as the salience), then a second pass of the question (the rows after
  the last image) and the P most salient tokens of each image found stale
  (``z`` averaged over layers >= 0.5), the rest of those images patched from them.
  The text between the images keeps the first pass's K/V.

Run ``python -m training.probe_choice --help``; docs/repair-design.md holds the
measured table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from harness.fidelity import scenario_requests
from harness.fidelity_task import model_split
from training.repair_study import (
    AUTO_THRESHOLD,
    CONTROLS,
    MODEL,
    STALE_SCENARIOS,
    Case,
    PatchConfig,
    Runner,
    _carry,
    _encode,
    _extrapolate,
    _image_runs,
    _rows,
    _strip,
    bootstrap,
    correct,
    keep_fn,
    patch_flops,
    positions_of,
    probe_images,
    probe_masks,
    probe_offsets,
    probe_staleness,
    scoring_rows,
    stalepatch_fn,
)

CHOSEN = PatchConfig(4, "kernel", 0.0)  # repair_study's pick on validation


def tail_salience(attentions, spans, tail: slice) -> list[torch.Tensor]:
    """Per span ``(n,)``: the attention the rows ``tail`` pay each of its tokens, mean
    over layers, heads and those rows (``attentions``: per layer ``(H, S, S)``)."""
    mass = torch.stack([a[:, tail, :].mean((0, 1)) for a in attentions]).mean(0)
    return [mass[s:e] for s, e in spans]


@torch.no_grad()
def attentions_of(runner: Runner, inputs: dict, fn=None) -> list[torch.Tensor]:
    """Per layer the ``(H, S, S)`` float32 attention of one forward (eager attention,
    with ``fn`` as the K/V hook); the model goes back to its own attention after."""
    own = runner.model.config._attn_implementation
    runner.model.set_attn_implementation("eager")
    runner.hook.fn = fn
    try:
        out = runner.model(**inputs, output_attentions=True)
    finally:
        runner.hook.fn = None
        runner.model.set_attn_implementation(own)
    return [a[0].float() for a in out.attentions]


def question_salience(attentions, case: Case) -> list[torch.Tensor]:
    """What the target's question (its rows after the last reused image) reads of each
    reused image, in these layers' attentions."""
    last = max(e for _, e in case.spans)
    return tail_salience(attentions, case.spans, slice(last, case.prompt_len))


def oracle_salience(runner: Runner, case: Case, layers: int | None = None) -> list[torch.Tensor]:
    """What the target's question reads of each reused image at full prefill (in its
    first ``layers`` layers; default all)."""
    return question_salience(attentions_of(runner, case.inputs)[:layers], case)


def fill_salience(runner: Runner, example, case: Case) -> list[torch.Tensor]:
    """What the warm-up's question read of each image the target reuses (the rows
    after the warm-up's last image)."""
    warmups, _ = scenario_requests(example, case.scenario, _carry)
    warm = _encode(runner.processor, *_strip(warmups[0]))
    runs = _image_runs(warm.inputs["input_ids"][0], warm.image_token_id)
    att = attentions_of(runner, warm.inputs)
    last = max(e for _, e in runs)
    warm_spans = [(s - d, e - d) for (s, e), d in zip(case.spans, case.deltas, strict=True)]
    return tail_salience(att, warm_spans, slice(last, warm.inputs["input_ids"].shape[1]))


def one_pass(runner: Runner, case: Case, offs: dict[int, list[int]]) -> tuple[bool, float]:
    """``(correct, FLOPs fraction)`` of the chosen stalepatch with these probes."""
    stats: dict = {}
    fn, _ = stalepatch_fn(case, CHOSEN, stats, offs=offs)
    ok = correct(runner.model, runner.hook, case, fn)
    flops = runner.shape.pass_flops(positions_of(scoring_rows(case, offs)))
    flops += patch_flops(runner.shape, case, CHOSEN, stats.get("patched", 0))
    return ok, flops / runner.full(case)


def two_pass(runner: Runner, case: Case, probes: int) -> tuple[bool, float]:
    """``(correct, FLOPs fraction)`` of the two-pass variant (module docstring)."""
    probed = probe_images(case)
    mids = {j: probe_offsets(case.grids[j], 1) for j in probed}
    masks = probe_masks(case, mids)
    record: dict = {}
    first: list = []
    inner = keep_fn(case, lambda j, layer: masks[j], record=record)

    def pass_one(layer, k, v):
        k, v = inner(layer, k, v)
        first.append((k.clone(), v.clone()))
        return k, v

    alpha = question_salience(attentions_of(runner, case.inputs, pass_one), case)
    layers = len(first)
    z = probe_staleness(case, mids, record)
    chosen = {
        j: sorted(alpha[j].topk(min(probes, alpha[j].numel())).indices.tolist())
        for j in probed
        if z[j] / layers >= AUTO_THRESHOLD
    }
    flops = runner.shape.pass_flops(positions_of(scoring_rows(case, mids)))
    if not chosen:  # the first pass is the answer: its K/V everywhere
        ok = correct(runner.model, runner.hook, case, lambda layer, k, v: first[layer])
        return ok, flops / runner.full(case)
    total = case.inputs["input_ids"].shape[1]
    computed = torch.zeros(total, dtype=torch.bool)
    computed[max(e for _, e in case.spans) :] = True
    for j, o in chosen.items():
        computed[torch.tensor(o) + case.spans[j][0]] = True
    cfg = PatchConfig(probes, CHOSEN.form, 0.0)

    def pass_two(layer, k, v):
        k, v = k.clone(), v.clone()
        fk, fv = first[layer]
        k[~computed], v[~computed] = fk[~computed], fv[~computed]
        for j, o in chosen.items():
            rows = _rows(case, j)
            sk, sv = case.stale[j][layer]
            ck, cv = k[rows][o], v[rows][o]
            nk, nv = sk.clone(), sv.clone()
            if layer > 0:
                nk = nk + _extrapolate(cfg, sk, o, ck - sk[o])
                nv = nv + _extrapolate(cfg, sv, o, cv - sv[o])
            nk[o], nv[o] = ck, cv
            k[rows], v[rows] = nk, nv
        return k, v

    ok = correct(runner.model, runner.hook, case, pass_two)
    rows_two = computed[: case.prompt_len].clone()
    rows_two[-1] = True
    flops += runner.shape.pass_flops(positions_of(rows_two))
    # (counts P probes' elementwise work in every probed image: an upper bound)
    flops += patch_flops(runner.shape, case, cfg, len(chosen) * (layers - 1))
    return ok, flops / runner.full(case)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=MODEL)
    parser.add_argument("--split", default="validation")
    parser.add_argument("--num", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=Path("training/results/repair-study"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    runner = Runner(args.model_path)
    examples = model_split(args.model_path, args.split, args.num)
    scenarios = (*STALE_SCENARIOS, *CONTROLS)
    raw: dict = {sc: {} for sc in scenarios}
    refs: dict = {sc: [] for sc in scenarios}
    for i, example in enumerate(examples):
        built = runner.cases(args.split, 1, scenarios, start=i)
        for sc in scenarios:
            case = built[sc][0]
            refs[sc].append(case.ref_correct)
            probed = probe_images(case)
            full = attentions_of(runner, case.inputs)  # one forward for both readings
            oracle, layer0 = question_salience(full, case), question_salience(full[:1], case)
            fill = fill_salience(runner, example, case)

            n = CHOSEN.probes

            def top(sal, j):
                return sorted(sal[j].topk(CHOSEN.probes).indices.tolist())

            runs = {
                "grid": one_pass(
                    runner, case, {j: probe_offsets(case.grids[j], n) for j in probed}
                ),
                "salient-oracle": one_pass(runner, case, {j: top(oracle, j) for j in probed}),
                "salient-fill": one_pass(runner, case, {j: top(fill, j) for j in probed}),
                "salient-layer0": one_pass(runner, case, {j: top(layer0, j) for j in probed}),
                "two-pass P=4": two_pass(runner, case, 4),
                "two-pass P=6": two_pass(runner, case, 6),
            }
            for label, (ok, f) in runs.items():
                cell = raw[sc].setdefault(label, {"ok": [], "f": []})
                cell["ok"].append(ok)
                cell["f"].append(f)
        if (i + 1) % 12 == 0:
            print(f"{i + 1}/{args.num} ({time.time() - t0:.0f} s)", flush=True)
    table: dict = {}
    for sc in scenarios:
        table[sc] = {}
        for label, cell in raw[sc].items():
            out = bootstrap(refs[sc], cell["ok"])
            out["flops"] = round(sum(cell["f"]) / len(cell["f"]), 4)
            out["outcomes"] = [int(x) for x in cell["ok"]]
            table[sc][label] = out
    report = {
        "model": str(args.model_path),
        "commit": commit,
        "split": args.split,
        "num": args.num,
        "seconds": round(time.time() - t0),
        "config": CHOSEN.label,
        "results": table,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"probe_choice_{args.split}.json").write_text(json.dumps(report, indent=1))
    print(markdown(report))


def markdown(report: dict) -> str:
    labels = list(next(iter(report["results"].values())))
    scenarios = list(report["results"])
    lines = [
        f"{report['config']} with each choice of probes, {report['model']}, "
        f"{report['split']}[0:{report['num']}], commit {report['commit']}: "
        "relative accuracy [95 %] / FLOPs fraction.",
        "",
        "| probes | " + " | ".join(f"`{sc}`" for sc in scenarios) + " |",
        "|---|" + "---|" * len(scenarios),
    ]
    for label in labels:
        cells = []
        for sc in scenarios:
            c = report["results"][sc][label]
            lo, hi = c["relative_ci"]
            cells.append(f"{c['relative']:.3f} [{lo:.3f}, {hi:.3f}] / {c['flops']:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
