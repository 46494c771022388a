"""``refresh/rank_agreement.py`` over two real gloo ranks (``torch.multiprocessing``):
the parts of the ranks' statistics summed so that a scorer picks on both what it
picks at TP 1 over every head, plan signatures and failure flags agreed, and
nothing run at TP 1.

Each scenario runs in both ranks and returns what each rank saw; the assertions
are made here on both results.
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sgl_mmkv.refresh.rank_agreement import (
    PeerFailed,
    RankAgreement,
    plan_signature,
)
from sgl_mmkv.refresh.selection import TokenSelector
from sgl_mmkv.scoring import ScoringInputs, make_refresh_scorer
from sgl_mmkv.scoring.base import LayerInputs

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        group = dist.group.WORLD
        out = {}
        for name, scenario in SCENARIOS.items():
            out[name] = scenario(rank, RankAgreement(group, group, WORLD))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> dict:
    """Every scenario of ``SCENARIOS`` run in two gloo ranks (one spawn for all: a
    spawned rank imports the refresh path): ``{scenario: [rank 0's, rank 1's]}``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    return {name: [got[r][name] for r in range(WORLD)] for name in SCENARIOS}


SPANS = ((2, 10), (10, 18))  # two 8-token images in a row of 22 tokens
PROBES = torch.tensor([6, 14])  # staleprobe's probes, one per image


def _layer(layer: int, rank: int | None) -> LayerInputs:
    """One layer as TP 1 (``rank`` None: both KV heads) or a rank (its KV head and its
    two query heads) holds it. The keys are equal, so every visual token gets the same
    attention mass; V of the first image is large on head 0 alone (norms 3 and ~0),
    of the second on both heads (2 and 2): each rank alone favours another image, the
    ranks' mean of norms favours the second (2 > 1.5), the norm over both heads the
    first (3 > 2.83)."""
    g = torch.Generator().manual_seed(layer)
    queries = torch.randn(4, 4, 8, generator=g)
    values = 0.01 * torch.randn(22, 2, 8, generator=g)
    values[2:10, 0, 0] += 3.0
    values[10:18, :, 0] += 2.0
    heads = slice(0, 2) if rank is None else slice(rank, rank + 1)
    return LayerInputs(
        layer=layer,
        queries=queries[:, 2 * heads.start : 2 * heads.stop],
        keys=torch.zeros(22, 2, 8)[:, heads],
        query_positions=torch.arange(18, 22),
        visual_positions=torch.arange(2, 18),
        visual_values=values[2:18, heads],
    )


def _kv(layer: int, rank: int | None) -> tuple[torch.Tensor, ...]:
    """The probes' stale and fresh ``(2, H, d)`` K/V at one layer, as :func:`_layer`."""
    g = torch.Generator().manual_seed(100 + layer)
    kv = [torch.randn(2, 2, 8, generator=g) for _ in range(2)]
    fresh = [x + torch.rand(2, 2, 1, generator=g) * torch.randn(2, 2, 8, generator=g) for x in kv]
    heads = slice(0, 2) if rank is None else slice(rank, rank + 1)
    return tuple(x[:, heads] for x in (*kv, *fresh))


def _inputs(scorer, rank: int | None, parts: bool) -> ScoringInputs:
    """A request as the scoring pass hands it over: 2 layers of ``scorer``'s statistics
    (``parts``: this rank's parts) and staleprobe's probe deviations."""
    if parts:
        stats = torch.stack([scorer.layer_parts(_layer(i, rank)) for i in (0, 1)])
        probes = torch.stack([scorer.deviation_parts(*_kv(i, rank)) for i in (0, 1)])
    else:
        stats = torch.stack([scorer.layer_statistic(_layer(i, rank)) for i in (0, 1)])
        probes = torch.stack([scorer.deviation(*_kv(i, rank)) for i in (0, 1)])
    return ScoringInputs(
        (),
        (),
        (),
        torch.arange(18, 22),
        SPANS,
        layer_ids=(0, 1),
        layer_statistics=stats,
        probe_positions=PROBES,
        probe_deviation=probes,
    )


def _unprobed(inputs: ScoringInputs) -> ScoringInputs:
    """``inputs`` without probes: staleprobe ranks by its layer statistics alone."""
    return replace(inputs, probe_positions=None, probe_deviation=None)


def _pick(rank: int, agreement: RankAgreement) -> dict:
    """Each rank's own pick (its heads' statistics finished alone), the ranks' mean
    of their statistics (what they agreed on before), and the pick after the sum of
    their parts."""
    scorer = make_refresh_scorer("staleprobe", use_value_norm=True)
    selector = TokenSelector(scorer, 0.25, None, None, agreement)
    own = _inputs(scorer, rank, parts=False)
    (mean_stats,) = agreement.sum([own.layer_statistics])
    mean = _unprobed(replace(own, layer_statistics=mean_stats / WORLD))
    before = agreement.collectives
    agreed = selector._agreed({0: _inputs(scorer, rank, parts=True)})[0]
    return {
        "local": scorer.select(_unprobed(own), 0.25).tolist(),
        "mean": scorer.select(mean, 0.25).tolist(),
        "agreed": scorer.select(_unprobed(agreed), 0.25).tolist(),
        "stats": agreed.layer_statistics,
        "probes": agreed.probe_deviation,
        "collectives": agreement.collectives - before,
    }


def _sum(rank: int, agreement: RankAgreement) -> dict:
    a = torch.full((2, 3), float(rank + 1))
    b = torch.arange(4, dtype=torch.float32) * (rank + 1)
    out = agreement.sum([a, b])
    return {"out": out, "collectives": agreement.collectives}


def _flags(rank: int, agreement: RankAgreement) -> dict:
    return {
        "none": agreement.any_failed(False),
        "rank1": agreement.any_failed(rank == 1),
        "both": agreement.any_failed(True),
        "collectives": agreement.collectives,
    }


def _plans(rank: int, agreement: RankAgreement) -> dict:
    # request 0 planned alike, request 1 differently (an L3 hit on rank 1 only)
    signatures = [111, 222 if rank == 0 else 333]
    same, failed = agreement.plans(signatures, 2, False)
    # rank 1 failed to plan: no signatures, every rank sees the failure
    same_f, failed_f = agreement.plans(None if rank == 1 else signatures, 2, rank == 1)
    return {"same": same, "failed": failed, "failed_f": failed_f, "same_f": same_f}


def _check(rank: int, agreement: RankAgreement) -> dict:
    error = RuntimeError("boom") if rank == 1 else None
    try:
        agreement.check(error, "copy")
    except PeerFailed as raised:
        caught = str(raised)
    else:
        caught = None
    agreement.check(None, "selection")  # nobody failed: no raise
    return {"caught": caught, "collectives": agreement.collectives}


def _all_of(rank: int, agreement: RankAgreement) -> dict:
    # image 0's embeddings on both ranks' stores, image 1's on rank 0's only
    return {"usable": agreement.all_of([True, rank == 0, False]), "n": agreement.collectives}


SCENARIOS = {
    "all_of": _all_of,
    "pick": _pick,
    "sum": _sum,
    "flags": _flags,
    "plans": _plans,
    "check": _check,
}


def test_ranks_pick_what_tp1_picks_after_the_sum_of_their_parts(ranks):
    """Staleprobe with the value norm: its layer statistics (mass x value norm) and
    probe deviations, summed over the ranks as parts in one all-reduce, are TP 1's
    over both heads; each rank alone, and the ranks' mean of norms, pick otherwise."""
    r0, r1 = ranks["pick"]
    scorer = make_refresh_scorer("staleprobe", use_value_norm=True)
    tp1 = _inputs(scorer, None, parts=False)
    tp1_pick = scorer.select(_unprobed(tp1), 0.25).tolist()
    assert r0["local"] != r1["local"]  # what each rank's own heads pick
    assert r0["mean"] == r1["mean"] != tp1_pick  # the ranks' mean of norms: agreed, not TP 1's
    assert r0["agreed"] == r1["agreed"] == tp1_pick
    assert max(tp1_pick) < 10  # the first image: its V norm over both heads is larger
    for r in (r0, r1):
        torch.testing.assert_close(r["stats"], tp1.layer_statistics, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(r["probes"], tp1.probe_deviation, rtol=1e-6, atol=0.0)
        assert r["collectives"] == 1  # statistics and probes in one all-reduce


def test_sum_is_one_all_reduce_of_every_tensor(ranks):
    r0, r1 = ranks["sum"]
    for r in (r0, r1):
        a, b = r["out"]
        torch.testing.assert_close(a, torch.full((2, 3), 3.0))
        torch.testing.assert_close(b, torch.arange(4, dtype=torch.float32) * 3)
        assert r["collectives"] == 1


def test_a_failure_on_one_rank_is_every_rank_s(ranks):
    r0, r1 = ranks["flags"]
    for r in (r0, r1):
        assert (r["none"], r["rank1"], r["both"]) == (False, True, True)
        assert r["collectives"] == 3


def test_plans_agree_per_request_and_a_failed_plan_fails_every_rank(ranks):
    r0, r1 = ranks["plans"]
    for r in (r0, r1):
        assert r["same"] == [True, False] and r["failed"] is False
        assert r["failed_f"] is True


def test_check_raises_peer_failed_on_every_rank(ranks):
    r0, r1 = ranks["check"]
    assert r0["caught"] == "copy"  # rank 0 did not fail, it follows rank 1
    assert r1["caught"] == "copy: RuntimeError('boom')"
    assert r0["collectives"] == r1["collectives"] == 2


def test_embeddings_are_supplied_only_where_every_rank_holds_them(ranks):
    r0, r1 = ranks["all_of"]
    assert r0 == r1 == {"usable": [True, False, False], "n": 1}


def test_tp1_runs_no_collective_and_returns_its_inputs():
    single = RankAgreement()
    t = torch.ones(3)
    assert single.sum([t])[0] is t
    assert single.any_failed(True) is True and single.any_failed(False) is False
    assert single.plans([5, 6], 2, False) == ([True, True], False)
    assert single.all_of([True, False]) == [True, False]
    with pytest.raises(ValueError, match="boom"):
        single.check(ValueError("boom"), "copy")  # the error itself, as before
    scorer = make_refresh_scorer("staleprobe")
    inputs = {0: _inputs(scorer, None, parts=False)}
    assert TokenSelector(scorer, 0.25, None, None)._agreed(inputs) is inputs
    assert single.collectives == 0
    assert RankAgreement.of_tp_group().world_size == 1  # no SGLang group here


def test_plan_signature_tells_plans_apart():
    from sgl_mmkv.refresh.plan import RequestPlan, ReuseSpan
    from sgl_mmkv.segments.store import Segment

    def plan(delta: int = 3, kept=None, holes: bool = False) -> RequestPlan:
        segment = Segment(None, torch.arange(8), torch.zeros(3, 8, dtype=torch.long), kept=kept)
        return RequestPlan(0, 0, 20, spans=(ReuseSpan(4, 12, segment, delta),), holes=holes)

    base = plan_signature(plan())
    assert base == plan_signature(plan())  # the same plan on another rank
    assert 0 <= base < 2**62
    assert base != plan_signature(plan(delta=4))
    assert base != plan_signature(plan(kept=torch.arange(0, 8, 2)))  # a compressed segment
    assert base != plan_signature(plan(holes=True))
    assert base != plan_signature(RequestPlan(0, 0, 20))  # a miss on one rank


class _Peers(RankAgreement):
    """Another rank's answers, as :meth:`RankAgreement.plans` would return them."""

    def __init__(self, same: list[bool], failed: bool = False):
        super().__init__()
        self.world_size, self.answer = 2, (same, failed)

    def plans(self, signatures, size, failed):
        return self.answer[0], self.answer[1] or failed


def _two_plans():
    from sgl_mmkv.refresh.plan import RequestPlan, ReuseSpan
    from sgl_mmkv.segments.store import Segment

    segment = Segment(None, torch.arange(8), torch.zeros(3, 8, dtype=torch.long))
    span = ReuseSpan(4, 12, segment, 3)
    return (RequestPlan(0, 0, 20, spans=(span,)), RequestPlan(1, 0, 20, spans=(span,), holes=True))


def test_a_request_planned_differently_on_another_rank_reuses_nothing_on_this_one():
    """An L3 hit on one rank and a miss on the other (or a missed deadline): the
    request's plans differ, it reuses nothing on every rank, and it is counted."""
    from sgl_mmkv.refresh.planning import ExtendPlanner
    from sgl_mmkv.refresh.report import RefreshCounters

    counters = RefreshCounters()
    planner = ExtendPlanner(
        None,
        make_refresh_scorer("conduit"),
        1.0,
        "always",
        counters,
        agreement=_Peers([True, False]),
    )
    kept, dropped = planner._agreed(_two_plans(), 2, None)
    assert len(kept.spans) == 1 and dropped.spans == () and dropped.holes is False
    assert counters.rank_disagreements == 1
    failing = ExtendPlanner(
        None, make_refresh_scorer("conduit"), 1.0, "always", counters, agreement=_Peers([], True)
    )
    with pytest.raises(PeerFailed, match="^plan$"):  # the other rank failed to plan
        failing._agreed(_two_plans(), 2, None)


def _fill(start: int, key: str = "k"):
    from sgl_mmkv.refresh.plan import FillCandidate

    return FillCandidate(key, start, start + 8, torch.zeros(3, 8, dtype=torch.long))


def test_new_images_enter_the_signature_where_they_shape_a_collective():
    from sgl_mmkv.refresh.plan import RequestPlan

    plain, filling = RequestPlan(0, 0, 20), RequestPlan(0, 0, 20, fills=(_fill(4),))
    assert plan_signature(plain) == plan_signature(filling)  # a copy fill runs nothing
    assert plan_signature(plain, with_fills=True) != plan_signature(filling, with_fills=True)


@pytest.mark.parametrize("agree_fills", [False, True])
def test_a_request_whose_new_images_differ_between_ranks_stores_none(agree_fills):
    """With an eviction ranking or a canonical fill, a request whose new images differ
    between ranks stores none of them on any rank (a copy fill alone keeps its own)."""
    from sgl_mmkv.refresh.plan import RequestPlan
    from sgl_mmkv.refresh.planning import ExtendPlanner
    from sgl_mmkv.refresh.report import RefreshCounters

    counters = RefreshCounters()
    scorer = make_refresh_scorer("conduit")
    planner = ExtendPlanner(
        None, scorer, 1.0, "always", counters, agreement=_Peers([False]), agree_fills=agree_fills
    )
    (plan,) = planner._agreed((RequestPlan(0, 0, 20, fills=(_fill(4),)),), 1, None)
    assert len(plan.fills) == (0 if agree_fills else 1)
    assert counters.rank_disagreements == int(agree_fills)


class _Reserving:
    """A segment store that reserves the keys in ``room`` (pinned segments)."""

    def __init__(self, room: set[str]) -> None:
        from types import SimpleNamespace

        self.room, self.discarded = room, []
        self.counters = SimpleNamespace(canonical_skipped=0)
        self._segment = lambda key: SimpleNamespace(key=key, pinned=False)

    def reserve(self, key, size, positions, ranking):
        return self._segment(key) if key in self.room else None

    def discard(self, key) -> None:
        self.discarded.append(key)


class _Flags(RankAgreement):
    """Another rank's flags, ANDed with this rank's as :meth:`all_of` would."""

    def __init__(self, other: list[bool]):
        super().__init__()
        self.world_size, self.other = 2, other

    def all_of(self, flags):
        return [a and b for a, b in zip(flags, self.other, strict=True)]


def _canonical(store, agreement, error=None):
    from types import SimpleNamespace

    from sgl_mmkv.refresh.fill import SegmentFiller
    from sgl_mmkv.refresh.plan import RequestPlan

    filler = SegmentFiller(store, None, "canonical", None, agreement)
    ran = []
    filler._run_canonical = lambda ctx, chosen: ran.extend(f.key for _, f, _ in chosen)
    plan = RequestPlan(0, 0, 40, fills=(_fill(4, "a"), _fill(20, "b")))
    fills = [(plan, f) for f in plan.fills]
    out = filler._fill_canonical(SimpleNamespace(), fills, {}, {}, error)
    return out, ran


def test_a_canonical_fill_runs_the_images_every_rank_reserved():
    store = _Reserving({"a", "b"})
    out, ran = _canonical(store, _Flags([True, False, True]))  # rank 1 had no room for b
    assert out is None and ran == ["a"] and store.discarded == ["b"]


def test_a_canonical_fill_another_rank_failed_runs_on_no_rank():
    store = _Reserving({"a", "b"})
    with pytest.raises(PeerFailed, match="^fill$"):
        _canonical(store, _Flags([True, True, False]))
    assert store.discarded == ["a", "b"]  # this rank's reservations given back
    with pytest.raises(PeerFailed):  # this rank failed earlier in the tail: nothing reserved
        _canonical(_Reserving({"a", "b"}), _Flags([True, True, True]), RuntimeError("x"))
    single = _Reserving({"a"})
    out, ran = _canonical(single, RankAgreement())  # TP 1: b found no room, a runs
    assert out is None and ran == ["a"] and single.discarded == []
