"""The refresh pass is left out when the scoring pass's output is already the batch's.

With nothing selected and no request asking for more than its last row, the refresh
pass would compute each request's last row again over the KV the scoring pass saw.
The executor then answers with the scoring pass's output: one pass, not two, the
same last rows, its FLOPs not counted. Anything selected, or a request asking every
row's logprobs, runs the refresh pass as before. The fake extend of
``tests/fake_extend.py`` plays the model (its output is the last layer's attention,
so it reads the KV each row attends to).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("sglang")

from sgl_mmkv.refresh.cost import only_last_rows, scoring_rows  # noqa: E402
from sgl_mmkv.refresh.executor import RefreshExecutor  # noqa: E402
from sgl_mmkv.refresh.passes import run_pass  # noqa: E402
from sgl_mmkv.refresh.probes import probe_rows  # noqa: E402
from sgl_mmkv.refresh.report import RefreshCounters, ReuseReporter  # noqa: E402
from sgl_mmkv.refresh.selection import TokenSelector  # noqa: E402
from sgl_mmkv.scoring import make_refresh_scorer  # noqa: E402
from tests.fake_extend import setup  # noqa: E402


class _NoCopy:
    """The segment KV is in the fake pool already."""

    def copy(self, model_runner, forward_batch, plans) -> None:
        pass


class _NoFill:
    def fill(self, ctx, rankings, error=None):
        return error


def _executor(name: str, budget: float) -> RefreshExecutor:
    counters = RefreshCounters()
    scorer = make_refresh_scorer(name)
    return RefreshExecutor(
        planner=None,
        copier=_NoCopy(),
        selector=TokenSelector(scorer, budget, _NoCopy(), counters),
        filler=_NoFill(),
        reporter=ReuseReporter(scorer.name, counters),
        counters=counters,
    )


def _counted(ctx):
    """``ctx`` whose extend runs are recorded: ``[(tokens per request, output)]``."""
    passes = []
    run = ctx.run_extend

    def counted(sub):
        out = run(sub)
        passes.append((list(sub.extend_seq_lens_cpu), out))
        return out

    return dataclasses.replace(ctx, run_extend=counted), passes


def _last_rows(lens: list[int]) -> torch.Tensor:
    return torch.tensor(lens).cumsum(0) - 1


@pytest.mark.parametrize("name", ["conduit", "prophetkv", "staleprobe"])
def test_nothing_selected_answers_with_the_scoring_pass(name):
    ctx, _ = setup(seed=3)
    ctx, passes = _counted(ctx)
    executor = _executor(name, 0.0)
    out = executor._reuse(ctx)
    assert len(passes) == 1  # the scoring pass alone
    lens, scoring_out = passes[0]
    assert out is scoring_out
    assert executor.counters.skipped_refresh_passes == 1
    assert executor.counters.refreshed_tokens == 0
    scored = []  # the scoring pass's rows: fresh, the last, staleprobe's probes
    for plan in ctx.plans:
        mask = scoring_rows(plan.fresh_mask())
        mask[probe_rows(plan, executor.scorer) - plan.prefix_len] = True
        scored.append(mask)
    assert executor.counters.executed_flops == ctx.pass_flops(scored)  # no refresh pass

    # The refresh pass it left out: each request's last row over the same KV.
    last = [torch.zeros(p.extend_len, dtype=torch.bool) for p in ctx.plans]
    for mask in last:
        mask[-1] = True
    assert only_last_rows(last)
    refreshed = run_pass(ctx, last)
    torch.testing.assert_close(out[_last_rows(lens)], refreshed, rtol=1e-5, atol=1e-6)


def test_a_selection_runs_the_refresh_pass():
    ctx, _ = setup(seed=3)
    ctx, passes = _counted(ctx)
    executor = _executor("conduit", 0.3)
    out = executor._reuse(ctx)
    assert len(passes) == 2
    assert out is passes[1][1]
    assert executor.counters.skipped_refresh_passes == 0
    assert executor.counters.refreshed_tokens > 0


def test_last_row_logprobs_still_answer_with_the_scoring_pass():
    """Both requests ask logprobs of their last row only: one pass."""
    ctx, _ = setup(seed=3)
    batch = ctx.forward_batch
    batch.return_logprob = True
    batch.extend_logprob_start_lens_cpu = [n - 1 for n in batch.extend_seq_lens_cpu]
    ctx, passes = _counted(ctx)
    executor = _executor("conduit", 0.0)
    assert executor._reuse(ctx) is passes[0][1]
    assert len(passes) == 1 and executor.counters.skipped_refresh_passes == 1


def test_every_row_asked_runs_the_refresh_pass():
    """Request 0 asks input logprobs of every prompt row, so the planner serves it
    without reuse; the refresh pass must compute all of its rows, so it runs next to
    request 1's reuse even with nothing selected."""
    ctx, _ = setup(seed=3)
    plan0, plan1 = ctx.plans
    ctx = dataclasses.replace(ctx, plans=(dataclasses.replace(plan0, spans=()), plan1))
    batch = ctx.forward_batch
    batch.return_logprob = True
    batch.extend_logprob_start_lens_cpu = [0, batch.extend_seq_lens_cpu[1] - 1]
    ctx, passes = _counted(ctx)
    executor = _executor("conduit", 0.0)
    out = executor._reuse(ctx)
    assert len(passes) == 2
    assert passes[1][0] == [plan0.extend_len, 1]
    assert out is passes[1][1]
    assert executor.counters.skipped_refresh_passes == 0
