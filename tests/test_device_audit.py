"""Device audit of the refresh path: no op mixes the pool's device with host tensors.

On a GPU a helper that builds an index on the CPU (``torch.arange`` without a device)
and uses it with tensors of the KV pool either raises (a CPU tensor indexed by CUDA
indices, as ``TokenScorer.select`` did) or copies it to the GPU behind the code's
back; the executor's fallback then hides the error and serves the batch as stock.
This machine has no GPU, so the audit makes a second device out of the CPU:

- :class:`OnDevice` is a tensor subclass holding real CPU data that reports the
  ``meta`` device, so the code under test sees a non-CPU device (``t.device``,
  ``device=t.device`` factories) while every op still computes real values: scorers
  select, masks are non-empty, ``nonzero`` and ``int()`` work, and each result is
  compared with the plain CPU run of the same helper, value for value. (Plain
  ``meta`` tensors carry no data, so data-dependent ops such as ``topk`` feeding an
  index, ``nonzero`` or ``int()`` could not run, and no result could be checked.)
- :class:`DeviceAudit`, a ``TorchDispatchMode``, sees every aten op. Factories asked
  for the audit device (``torch.arange(n, device=keys.device)``) get ``OnDevice``
  results; ``.to(device)`` / ``.cpu()`` / ``copy_`` are the explicit transfers, and
  are counted. Any other op that meets an ``OnDevice`` tensor and a host tensor
  with at least one dimension raises :class:`DeviceMix`. 0-dim host tensors are
  allowed, as CUDA kernels take them as scalars. This is stricter than CUDA in one
  case: CUDA lets a CPU index tensor select from a CUDA tensor, with a hidden
  host-to-device copy; the refresh path must make that copy on purpose, once.
- The audit also counts host syncs of device tensors (``int()``, ``bool()``,
  ``nonzero``, boolean-mask indexing, copies to the host), so that the tests can
  require helpers that run per layer to sync no more often with more layers.

What stays on the host by design: a request's plan (``RequestPlan`` masks, ``RowView``,
``RowPlan`` positions, a segment's ``positions`` / ``kept`` / ``ranking``) is built
from host facts and read by host code; it is moved to the pool's device where it
meets device tensors. Everything a scorer, ranker, copy or row read computes from
the pool's tensors stays on their device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from sgl_mmkv.kernels.gather_rotate import gather_rotate_kv, rope_inv_freq, rotate_neox
from sgl_mmkv.refresh.cost import refresh_rows, scoring_rows, unchanged_prefix
from sgl_mmkv.refresh.kv_copy import SegmentCopier
from sgl_mmkv.refresh.layer_statistics import LayerStatistics, ReducedRow
from sgl_mmkv.refresh.observer import PrefillObserver
from sgl_mmkv.refresh.plan import FillCandidate, RequestPlan, ReuseSpan, plan_request
from sgl_mmkv.refresh.ranker import VisualRanker
from sgl_mmkv.refresh.row_compaction import RowCompactor, dropped_positions
from sgl_mmkv.refresh.row_kv import kv_at, row_keys, row_kv, row_slots, row_slots_at
from sgl_mmkv.refresh.row_view import RowView
from sgl_mmkv.refresh.sub_batch import active_sub_batch
from sgl_mmkv.scoring import EVICTION_SCORERS, REFRESH_SCORERS, ScoringInputs, top_tokens
from sgl_mmkv.segments.key import NAMESPACE_ATTR, Namespace, item_key
from sgl_mmkv.segments.store import Segment, SegmentStore

AUDIT_DEVICE = torch.device("meta")
aten = torch.ops.aten

# -- the audit -------------------------------------------------------------------------


class DeviceMix(AssertionError):
    """An op met a device tensor and a host tensor without an explicit transfer."""


_TRANSFERS = {aten._to_copy, aten.copy_}
_SYNCS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten.equal,
    aten.is_nonzero,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
}
_audits: list[DeviceAudit] = []


def _audit_device(device) -> bool:
    return device is not None and torch.device(device).type == AUDIT_DEVICE.type


class OnDevice(torch.Tensor):
    """Real CPU data ``elem`` reporting :data:`AUDIT_DEVICE`."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=AUDIT_DEVICE,
            requires_grad=False,
        )

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    def tolist(self):
        for audit in _audits[-1:]:
            audit.syncs.append("tolist")
        return self.elem.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {}, None)


def _describe(tensors) -> str:
    return ", ".join(
        f"{'device' if isinstance(t, OnDevice) else 'host'} {tuple(t.shape)}" for t in tensors
    )


def _run(func, args, kwargs, audit):
    tensors = [t for t in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
    on_device = [t for t in tensors if isinstance(t, OnDevice)]
    host = [t for t in tensors if not isinstance(t, OnDevice)]
    stray = [t for t in host if t.device.type != "cpu"]
    if stray:
        raise DeviceMix(f"{func}: a real {stray[0].device} tensor, which holds no data")
    packet = func.overloadpacket
    target = kwargs.get("device")
    if on_device and packet not in _TRANSFERS and any(t.dim() for t in host):
        raise DeviceMix(f"{func} mixes devices: {_describe(tensors)}")
    if _audit_device(target):
        if kwargs.get("generator") is not None:
            raise DeviceMix(f"{func}: a host generator for a device tensor")
        kwargs = {**kwargs, "device": torch.device("cpu")}
    if packet is aten._to_copy:
        to_device = _audit_device(target) or (target is None and bool(on_device))
    elif packet is aten.copy_:
        to_device = isinstance(args[0], OnDevice)
    else:
        to_device = bool(on_device) or _audit_device(target)
    if audit is not None:
        audit.record(packet, args, on_device, to_device)
    originals = {id(t.elem if isinstance(t, OnDevice) else t): t for t in tensors}
    args, kwargs = pytree.tree_map_only(OnDevice, lambda t: t.elem, (args, kwargs))
    out = func(*args, **kwargs)

    def wrap(t: torch.Tensor) -> torch.Tensor:
        if id(t) in originals:  # an in-place op returns its own argument
            return originals[id(t)]
        return OnDevice(t) if to_device else t

    return pytree.tree_map_only(torch.Tensor, wrap, out)


def _tensor_factory(original):
    def build(data, *args, device=None, **kwargs):
        if _audit_device(device):
            return original(data, *args, **kwargs).to(AUDIT_DEVICE)
        return original(data, *args, device=device, **kwargs)

    return build


class DeviceAudit(TorchDispatchMode):
    """Fails any op mixing device and host tensors; counts syncs and transfers.

    Attributes:
        syncs: ops that wait for the device (``int()``, ``nonzero``, downloads...).
        uploads: host-to-device copies.
        downloads: shapes of device-to-host copies.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.uploads = 0
        self.downloads: list[tuple[int, ...]] = []
        self._factories = {}

    def record(self, packet, args, on_device, to_device) -> None:
        if packet in _TRANSFERS:
            source = args[1] if packet is aten.copy_ else args[0]
            if isinstance(source, OnDevice) and not to_device:
                self.downloads.append(tuple(source.shape))
                self.syncs.append(str(packet))
            elif not isinstance(source, OnDevice) and to_device:
                self.uploads += 1
        elif on_device and packet in _SYNCS:
            self.syncs.append(str(packet))
        elif packet in (aten.index, aten.index_put_, aten._index_put_impl_) and any(
            isinstance(i, OnDevice) and i.dtype == torch.bool for i in args[1] if i is not None
        ):
            self.syncs.append("boolean mask index")

    def __enter__(self):
        _audits.append(self)
        for name in ("tensor", "as_tensor"):
            self._factories[name] = getattr(torch, name)
            setattr(torch, name, _tensor_factory(self._factories[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        _audits.pop()
        for name, original in self._factories.items():
            setattr(torch, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {}, self)


def on_device(x):
    """``x`` with every tensor (in tuples, lists, dicts) a copy on the audit device."""
    return pytree.tree_map_only(torch.Tensor, lambda t: OnDevice(t.clone()), x)


def host(x):
    """``x`` with every audit-device tensor replaced by its data."""
    return pytree.tree_map_only(OnDevice, lambda t: t.elem, x)


def assert_on_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert isinstance(t, OnDevice) and t.device == AUDIT_DEVICE, f"{type(t)} on {t.device}"


# -- the audit catches what it must -------------------------------------------------------


def test_the_audit_fails_a_host_index_of_device_scores_and_allows_scalars():
    scores = on_device(torch.tensor([0.3, 0.9, 0.1, 0.7]))
    with DeviceAudit(), pytest.raises(DeviceMix, match="index"):
        torch.arange(4, 8)[torch.topk(scores, 2).indices]  # issue 34: select's bug
    with DeviceAudit() as audit:
        scaled = scores * torch.tensor(2.0) + 1  # a 0-dim host tensor is a scalar
        picked = torch.arange(4, 8, device=scores.device)[torch.topk(scaled, 2).indices]
        moved = torch.tensor([1, 2], device=scores.device)
        assert int(picked.sort().values[0]) == 5
    assert_on_device(scaled, picked, moved)
    assert audit.syncs == ["aten._local_scalar_dense"] and audit.uploads == 1
    with DeviceAudit(), pytest.raises(DeviceMix, match="mixes devices"):
        torch.cat([scores, torch.zeros(2)])


# -- scorers ------------------------------------------------------------------------------

BUDGET = 0.3
HIDDEN, H_Q, H_KV, D = 12, 4, 2, 8
SPANS = ((4, 12), (14, 20))
ROW = 26
SCORERS = [(REFRESH_SCORERS, name) for name in sorted(REFRESH_SCORERS)] + [
    (EVICTION_SCORERS, name) for name in sorted(EVICTION_SCORERS)
]
SCORER_IDS = [name for _, name in SCORERS]
# Scorers whose host syncs may grow with the layers scored, and why.
PER_LAYER_SYNCS = {
    "aircache": "its layer budgets are capped one layer at a time, after the pass "
    "(each layer's elite set stays a mask on the device)",
}


# Scorers whose host-to-device copies may grow with the layers scored, and why.
PER_LAYER_UPLOADS = {
    "mmshiftkv": "its per-layer noise is drawn on the host, so every device ranks alike; "
    "it ranks an image once when it is stored, never inside a refresh pass",
}


@dataclasses.dataclass
class Projector:
    """MM-ShiftKV's ``project_queries``: a per-layer ``q_proj`` and neox RoPE."""

    weights: tuple[torch.Tensor, ...]
    inv_freq: torch.Tensor

    def __call__(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        w = self.weights[layer]
        q = (x.to(w.device, w.dtype) @ w).view(x.shape[0], H_Q, D)
        return rotate_neox(q, positions.to(w.device), self.inv_freq)

    def on_device(self) -> Projector:
        return Projector(on_device(self.weights), on_device(self.inv_freq))


def scoring_inputs(layers: int = 2, seed: int = 0) -> ScoringInputs:
    """A row of two images between text; every optional input is present, the
    attention-input statistics as the observer keeps them (0-dim tensors)."""
    g = torch.Generator().manual_seed(seed)
    visual = torch.zeros(ROW, dtype=torch.bool)
    for s, e in SPANS:
        visual[s:e] = True
    query_positions = (~visual).nonzero().flatten()
    keys = tuple(torch.randn(ROW, H_KV, D, generator=g) for _ in range(layers))
    values = tuple(torch.randn(ROW, H_KV, D, generator=g) for _ in range(layers))
    return ScoringInputs(
        queries=tuple(torch.randn(len(query_positions), H_Q, D, generator=g) for _ in keys),
        keys=keys,
        values=values,
        query_positions=query_positions,
        image_spans=SPANS,
        fresh_keys=tuple(k + 0.1 * torch.randn(k.shape, generator=g) for k in keys),
        fresh_values=tuple(v + 0.1 * torch.randn(v.shape, generator=g) for v in values),
        hidden_stats=tuple(
            (torch.tensor(0.1 * i), torch.tensor(1.0 + 0.2 * i), HIDDEN) for i in range(layers)
        ),
        project_queries=Projector(
            tuple(torch.randn(HIDDEN, H_Q * D, generator=g) for _ in keys), rope_inv_freq(D, 1e4)
        ),
    )


def inputs_on_device(inputs: ScoringInputs) -> ScoringInputs:
    fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    fields.pop("device", None)  # the keys'
    moved = {
        k: v.on_device() if isinstance(v, Projector) else on_device(v) for k, v in fields.items()
    }
    return ScoringInputs(**moved)


@pytest.mark.parametrize(("registry", "name"), SCORERS, ids=SCORER_IDS)
def test_a_scorer_selects_and_ranks_on_the_device_of_its_inputs(registry, name):
    scorer = registry[name]()
    inputs = scoring_inputs()
    expected_selection = scorer.select(inputs, BUDGET)
    expected_ranking = scorer.ranking(inputs, BUDGET)
    with DeviceAudit():
        device_inputs = inputs_on_device(inputs)
        selection = scorer.select(device_inputs, BUDGET)
        ranking = scorer.ranking(device_inputs, BUDGET)
        positions, images = device_inputs.visual_positions, device_inputs.image_ids()
    assert_on_device(selection, ranking, positions, images)
    assert torch.equal(host(selection), expected_selection)
    torch.testing.assert_close(host(ranking), expected_ranking, rtol=0, atol=0)
    assert torch.equal(host(positions), inputs.visual_positions)
    assert torch.equal(host(images), inputs.image_ids())


def _scorer_syncs(scorer, layers: int) -> tuple[list[str], int]:
    """The host waits of one selection: syncs, and host-to-device copies (a stream
    sync on CUDA from pageable memory), whose count is independent of the inputs'
    own moves (``inputs_on_device`` runs outside the audit)."""
    inputs = inputs_on_device(scoring_inputs(layers))
    with DeviceAudit() as audit:
        scorer.select(inputs, BUDGET)
    return audit.syncs, audit.uploads


@pytest.mark.parametrize(
    ("registry", "name"),
    [s for s in SCORERS if s[1] not in PER_LAYER_SYNCS],
    ids=[n for n in SCORER_IDS if n not in PER_LAYER_SYNCS],
)
def test_a_scorer_syncs_with_the_host_no_more_often_with_more_layers(registry, name):
    scorer = registry[name]()
    syncs, uploads = _scorer_syncs(scorer, 2)
    more_syncs, more_uploads = _scorer_syncs(scorer, 4)
    assert more_syncs == syncs
    assert more_uploads == uploads or name in PER_LAYER_UPLOADS
    if registry is REFRESH_SCORERS:  # selection between the passes never waits
        assert syncs == []
        assert uploads == (1 if name == "random" else 0)  # its draw is made on the host


def test_staleprobe_ranks_its_probes_on_the_device_without_a_sync():
    """The probe inputs (positions and per-layer deviations) stay on the device: the
    same selection and ranking as on the host, and no host sync."""
    scorer = REFRESH_SCORERS["staleprobe"]()
    probed = replace(
        scoring_inputs(),
        probe_positions=torch.tensor([8, 17]),
        probe_deviation=torch.tensor([[0.2, 1.0], [0.3, 2.0]]),
    )
    expected_selection = scorer.select(probed, BUDGET)
    expected_ranking = scorer.ranking(probed, BUDGET)
    assert 17 in expected_selection.tolist() and 8 not in expected_selection.tolist()
    with DeviceAudit() as audit:
        device_inputs = inputs_on_device(probed)
        selection = scorer.select(device_inputs, BUDGET)
        ranking = scorer.ranking(device_inputs, BUDGET)
    assert_on_device(selection, ranking)
    assert audit.syncs == []
    assert torch.equal(host(selection), expected_selection)
    torch.testing.assert_close(host(ranking), expected_ranking, rtol=0, atol=0)


def test_staleprobe_sizes_an_auto_budget_on_the_device_with_one_sync():
    """At ``auto`` the request's count of chosen tokens is known only on the device: the
    selection waits for it once (the mask's size), with 2 layers as with 4, and equals
    the host's."""
    scorer = REFRESH_SCORERS["staleprobe"](auto_threshold=0.3, auto_fraction=0.5)
    syncs = []
    for layers in (2, 4):
        probed = replace(
            scoring_inputs(layers),
            probe_positions=torch.tensor([8, 17]),
            probe_deviation=torch.tensor([[0.2, 1.0], [0.3, 2.0]]).repeat(layers // 2, 1),
        )
        expected = scorer.select(probed, "auto")
        assert 0 < expected.numel() < probed.num_visual
        device_inputs = inputs_on_device(probed)
        with DeviceAudit() as audit:
            selection = scorer.select(device_inputs, "auto")
        assert_on_device(selection)
        assert torch.equal(host(selection), expected)
        syncs.append((len(audit.syncs), audit.uploads))
    assert syncs == [(1, 0), (1, 0)]  # no host-to-device copy (three before)


def test_per_layer_sync_exceptions_name_registered_scorers():
    assert set(PER_LAYER_SYNCS) <= set(REFRESH_SCORERS) | set(EVICTION_SCORERS)
    assert set(PER_LAYER_UPLOADS) <= set(EVICTION_SCORERS)


def test_top_tokens_stay_on_the_ranking_device():
    ranking = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7])
    with DeviceAudit():
        kept = top_tokens(on_device(ranking), 0.6)
    assert_on_device(kept)
    assert host(kept).tolist() == top_tokens(ranking, 0.6).tolist() == [0, 2, 4]


# -- KV copy ------------------------------------------------------------------------------

SLOTS = 96


class Pool:
    """SGLang's KV pool contract: one ``(slots, H_kv, d)`` K and V buffer per layer."""

    def __init__(self, layers: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k = [torch.randn(SLOTS, H_KV, D, generator=g).to(dtype) for _ in range(layers)]
        self.v = [torch.randn(SLOTS, H_KV, D, generator=g).to(dtype) for _ in range(layers)]

    @property
    def layer_num(self) -> int:
        return len(self.k)

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def on_device(self) -> Pool:
        pool = Pool(0, dtype=self.k[0].dtype)
        pool.k, pool.v = on_device(self.k), on_device(self.v)
        return pool


@pytest.fixture
def reference_kernels(monkeypatch):
    """The torch paths (the Triton ones run only on CUDA or under the interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SGL_MMKV_TRITON_ATTENTION", raising=False)


PREFIX, SEQ = 2, 30


def reuse_plan(holes: bool = True) -> RequestPlan:
    """Request 1's row reuses a whole image at [6, 14) and a compressed one (tokens 0,
    2, 3 and 5 kept) at [18, 24); with ``holes`` its dropped tokens are holes."""
    whole = Segment(("a", 8), torch.arange(60, 68), torch.arange(8)[None])
    compressed = Segment(
        ("b", 6),
        torch.tensor([70, 72, 73, 75]),
        torch.arange(6)[None],
        kept=torch.tensor([0, 2, 3, 5]),
    )
    spans = [ReuseSpan(6, 14, whole, 6), ReuseSpan(18, 24, compressed, 18)]
    visual = torch.zeros(SEQ - PREFIX, dtype=torch.bool)
    visual[6 - PREFIX : 14 - PREFIX] = visual[18 - PREFIX : 24 - PREFIX] = True
    fills = (FillCandidate(("c", 4), 25, 29, torch.arange(25, 29)[None]),)
    return RequestPlan(
        1, PREFIX, SEQ, tuple(spans), fills, visual, ((6, 14), (18, 24)), holes=holes
    )


def on_device_segments(plan: RequestPlan) -> RequestPlan:
    """``plan`` with its segments' slots on the device (a segment's positions and kept
    indices are host facts)."""
    spans = [
        dataclasses.replace(
            s, segment=dataclasses.replace(s.segment, slots=on_device(s.segment.slots))
        )
        for s in plan.spans
    ]
    return dataclasses.replace(plan, spans=spans)


def runner(pool: Pool, table: torch.Tensor):
    return SimpleNamespace(
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=table), model=None
    )


def request_table() -> torch.Tensor:
    """``(3, SEQ + 2)`` int32 ``req_to_token``: pool row 2 holds request 1's slots."""
    table = torch.zeros(3, SEQ + 2, dtype=torch.int32)
    table[2, :SEQ] = torch.arange(SEQ, dtype=torch.int32) + 10
    return table


def batch(device: bool):
    fb = SimpleNamespace(
        req_pool_indices=torch.tensor([0, 2]),
        seq_lens=torch.tensor([5, SEQ]),
        seq_lens_cpu=torch.tensor([5, SEQ]),
    )
    if device:
        fb.req_pool_indices, fb.seq_lens = on_device((fb.req_pool_indices, fb.seq_lens))
    return fb


def _copy(layers: int, device: bool, dtype: torch.dtype = torch.float32):
    pool, table, plan = Pool(layers, dtype=dtype), request_table(), reuse_plan()
    copier = SegmentCopier()
    copier._rates = rope_inv_freq(D, 1e4)  # as rope_rates_of: on the host
    if not device:
        copier.copy(runner(pool, table), batch(False), [plan])
        return pool, None
    with DeviceAudit() as audit:
        moved = pool.on_device()
        copier.copy(runner(moved, on_device(table)), batch(True), [on_device_segments(plan)])
    return moved, audit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
@pytest.mark.parametrize("poison", [False, True])
def test_the_segment_copy_runs_on_the_pool_device_and_moves_once(
    poison, dtype, reference_kernels, monkeypatch
):
    """fp8: the copy writes the pool's bytes through uint8 views, on its device."""
    if poison:
        monkeypatch.setenv("SGL_MMKV_POISON_FREED", "1")
    expected, _ = _copy(3, device=False, dtype=dtype)
    before = Pool(3, dtype=dtype)
    bits = (lambda t: t.view(torch.uint8)) if dtype != torch.float32 else (lambda t: t)
    assert torch.equal(bits(expected.v[2][16:24]), bits(before.v[2][60:68]))  # row [6, 14)
    assert not torch.equal(bits(expected.k[2][16:24]), bits(before.k[2][60:68]))  # rotated
    pool, audit = _copy(3, device=True, dtype=dtype)
    for layer in range(3):
        exact = {"rtol": 0, "atol": 0, "equal_nan": True}
        torch.testing.assert_close(host(pool.k[layer]).float(), expected.k[layer].float(), **exact)
        torch.testing.assert_close(host(pool.v[layer]).float(), expected.v[layer].float(), **exact)
    _, more = _copy(6, device=True, dtype=dtype)
    assert audit.syncs == more.syncs == [] and audit.uploads == more.uploads


def test_gather_rotate_runs_on_the_device_without_a_sync(reference_kernels):
    k, v = torch.randn(16, H_KV, D), torch.randn(16, H_KV, D)
    src, dst, delta = torch.tensor([1, 2, 3]), torch.tensor([9, 10, 11]), torch.tensor([4, 4, -2])
    inv_freq = rope_inv_freq(D, 1e4)
    with DeviceAudit() as audit:
        k_dev, v_dev = on_device((k, v))
        gather_rotate_kv(k_dev, v_dev, *on_device((src, dst, delta, inv_freq)))
    gather_rotate_kv(k, v, src, dst, delta, inv_freq)
    assert torch.equal(host(k_dev), k) and torch.equal(host(v_dev), v)
    assert audit.syncs == [] and audit.uploads == 0
    with DeviceAudit(), pytest.raises(DeviceMix):
        gather_rotate_kv(k_dev, v_dev, *on_device((src, dst, delta)), inv_freq)


# -- row reads: row KV, row views ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_a_row_is_read_on_the_pool_device_without_a_sync(dtype):
    """fp8: the row comes back dequantized (float32), on the pool's device."""
    pool, table = Pool(3, dtype=dtype), request_table()
    keys, values = row_kv(runner(pool, table), batch(False), 1)
    with DeviceAudit() as audit:
        model_runner = runner(pool.on_device(), on_device(table))
        device_keys, device_values = row_kv(model_runner, batch(True), 1)
        some = row_keys(model_runner, batch(True), 1, layers=[2, 0])
    assert_on_device(*device_keys, *device_values, *some)
    assert {t.dtype for t in keys + values} == {torch.float32}  # values, not fp8 bytes
    pairs = zip(device_keys + device_values, keys + values, strict=True)
    assert all(torch.equal(host(a), b) for a, b in pairs)
    assert [host(k).tolist() for k in some] == [keys[2].tolist(), keys[0].tolist()]
    assert audit.syncs == [] and audit.uploads == 0


def test_some_row_positions_are_read_every_layer_with_one_upload():
    """The positions' slots are made on the device once per request (a host-to-device
    copy is a stream sync on CUDA), then every layer reads them without another."""
    pool, table = Pool(3), request_table()
    positions = torch.tensor([3, 7, 8, 20])
    keys, values = row_kv(runner(pool, table), batch(False), 1)
    with DeviceAudit() as audit:
        device_pool = pool.on_device()
        model_runner = runner(device_pool, on_device(table))
        slots = row_slots_at(model_runner, batch(True), 1, positions)
        read = [kv_at(device_pool, layer, slots) for layer in range(3)]
    for layer, (k, v) in enumerate(read):
        assert_on_device(k, v)
        assert torch.equal(host(k), keys[layer][positions])
        assert torch.equal(host(v), values[layer][positions])
    assert audit.syncs == [] and audit.uploads == 1  # the positions, once


def test_a_row_view_moves_its_index_once_for_every_layer():
    plan = reuse_plan()
    view = RowView.of(plan)
    layers = tuple(torch.randn(SEQ, H_KV, D) for _ in range(4))
    positions = torch.tensor([0, 6, 18, 29])
    with DeviceAudit():
        rows = view.rows(on_device(layers))
        compacted = view.compact(on_device(positions))
        expanded = view.expand(compacted)
    assert_on_device(*rows, compacted, expanded)
    assert all(torch.equal(host(a), b) for a, b in zip(rows, view.rows(layers), strict=True))
    assert host(compacted).tolist() == view.compact(positions).tolist()
    assert host(expanded).tolist() == positions.tolist()
    rows_only = DeviceAudit()
    with rows_only:
        view.rows(on_device(layers))
    assert rows_only.uploads == 1 and rows_only.syncs == []


# -- plans, costs, sub-batches ------------------------------------------------------------


def test_plan_masks_stay_on_the_host_and_source_slots_on_the_device():
    plan = reuse_plan()
    with DeviceAudit() as audit:
        device_plan = on_device_segments(plan)
        masks = [device_plan.fresh_mask(), device_plan.hole_mask(), device_plan.dropped_mask()]
        slots = [s.source_slots() for s in device_plan.spans]
        positions = [s.reused_positions() for s in device_plan.spans]
    assert all(not isinstance(m, OnDevice) for m in masks + positions)
    assert [m.tolist() for m in masks] == [
        m.tolist() for m in (plan.fresh_mask(), plan.hole_mask(), plan.dropped_mask())
    ]
    assert_on_device(*slots)
    assert [host(s).tolist() for s in slots] == [list(range(60, 68)), [70, 72, 73, 75]]
    assert audit.syncs == []


class SlotAllocator:
    """SGLang's token allocator contract (page size 1), its slots on ``device``."""

    def __init__(self, device: bool) -> None:
        self.free_slots = list(range(1, SLOTS))
        self.device = device

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> torch.Tensor:
        out, self.free_slots = torch.tensor(self.free_slots[:n]), self.free_slots[n:]
        return on_device(out) if self.device else out

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots += host(slots).tolist()


def _stored_plan(device: bool):
    """A store holding a ranked, then compressed image, and the plan that reuses it."""
    shared = Namespace(None, None)
    item = SimpleNamespace(hash=7, offsets=[(6, 13)], modality=SimpleNamespace(name="IMAGE"))
    mm = SimpleNamespace(mm_items=[item], mrope_positions=torch.arange(SEQ).repeat(3, 1))
    setattr(mm, NAMESPACE_ATTR, shared)
    pool = Pool(2)
    store = SegmentStore(SlotAllocator(device), pool.on_device() if device else pool)
    src = torch.arange(16, 24)
    ranking = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4, 0.6])
    if device:
        src, ranking = on_device((src, ranking))
    segment = store.fill(item_key(item, shared, 8), src, torch.arange(8).repeat(3, 1), ranking)
    store.compress(segment, 0.5)
    return segment, plan_request(store, 1, mm, PREFIX, SEQ - PREFIX), store


def test_the_segment_store_keeps_slots_on_the_device_and_its_facts_on_the_host():
    segment, plan, store = _stored_plan(device=False)
    with DeviceAudit():
        device_segment, device_plan, device_store = _stored_plan(device=True)
        slots = device_plan.spans[0].source_slots()
    assert_on_device(device_segment.slots, slots)
    assert not isinstance(device_segment.kept, OnDevice)
    assert not isinstance(device_segment.ranking, OnDevice)
    assert host(slots).tolist() == plan.spans[0].source_slots().tolist() == segment.slots.tolist()
    assert device_segment.kept.tolist() == segment.kept.tolist() == [1, 3, 5, 7]
    for layer in range(2):
        got = host(device_store.kv_pool.get_key_buffer(layer))[host(slots)]
        assert torch.equal(got, store.kv_pool.get_key_buffer(layer)[segment.slots])
    assert device_plan.reused_mask().tolist() == plan.reused_mask().tolist()


def test_refresh_rows_take_a_selection_on_the_device():
    plan = reuse_plan()
    fresh, selected = plan.fresh_mask(), torch.tensor([7, 9, 20])
    expected = refresh_rows(plan, fresh, selected, True, unchanged_prefix(plan, selected, True))
    with DeviceAudit():
        chosen = on_device(selected)
        skip = unchanged_prefix(plan, chosen, True)
        rows = refresh_rows(plan, fresh, chosen, True, skip)
        scored = scoring_rows(fresh)
    assert rows.tolist() == expected.tolist() and skip == unchanged_prefix(plan, selected, True)
    assert scored.tolist() == scoring_rows(fresh).tolist()


def test_a_sub_batch_indexes_the_device_tokens_with_a_device_index():
    lens = [5, 7]
    fb = SimpleNamespace(
        input_ids=torch.arange(12) + 100,
        positions=torch.arange(12),
        mrope_positions=torch.arange(36).view(3, 12),
        out_cache_loc=torch.arange(12) + 200,
        extend_seq_lens=torch.tensor(lens),
        extend_seq_lens_cpu=lens,
        extend_logprob_start_lens_cpu=[4, 6],
        return_logprob=False,
        input_embeds=None,
        forward_metadata_ready=True,
        mark_forward_metadata_ready=lambda: None,
    )
    masks = [torch.tensor([1, 0, 1, 0, 1]).bool(), torch.tensor([0, 0, 1, 1, 0, 0, 1]).bool()]
    expected, expected_index = active_sub_batch(fb, masks)
    with DeviceAudit():
        device_fb = SimpleNamespace(**{k: on_device(v) for k, v in vars(fb).items()})
        device_fb.extend_seq_lens_cpu = lens
        device_fb.extend_logprob_start_lens_cpu = [4, 6]
        sub, index = active_sub_batch(device_fb, masks)
    fields = ("input_ids", "positions", "mrope_positions", "out_cache_loc", "extend_seq_lens")
    assert_on_device(index, *(getattr(sub, f) for f in fields), sub.extend_start_loc)
    assert host(index).tolist() == expected_index.tolist()
    for f in (*fields, "extend_start_loc"):
        assert host(getattr(sub, f)).tolist() == getattr(expected, f).tolist(), f


# -- eviction ranking: observer and ranker ------------------------------------------------


def test_the_observer_keeps_queries_and_statistics_on_the_device_without_a_sync():
    lens = [5, 7]
    fb = SimpleNamespace(extend_seq_lens_cpu=lens)
    rows = {1: torch.tensor([0, 3, 6])}
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(12, H_Q * D, generator=g) for _ in range(3)]
    hidden = [torch.randn(12, HIDDEN, generator=g) for _ in range(3)]
    observer = PrefillObserver(rows)
    with DeviceAudit() as audit:
        for layer_id, (q, x) in enumerate(zip(on_device(qs), on_device(hidden), strict=True)):
            layer = SimpleNamespace(tp_q_head_num=H_Q, qk_head_dim=D, layer_id=layer_id)
            observer.observe_queries(q, layer, fb)
            observer.observe_hidden(layer_id, x, fb)
    assert audit.syncs == [] and audit.uploads == 1  # the rows, once
    for layer_id in range(3):
        kept = observer.queries[1][layer_id]
        assert_on_device(kept)
        assert torch.equal(host(kept), qs[layer_id].view(12, H_Q, D)[[5, 8, 11]])
        mean, std, width = observer.hidden_stats[1][layer_id]
        x = hidden[layer_id][5:]
        assert (float(mean), float(std), width) == (float(x.mean()), float(x.std()), HIDDEN)


def _observed(layers: int = 2, seed: int = 0) -> PrefillObserver:
    """What the refresh pass of ``reuse_plan()`` (text rows, no holes) observes."""
    plan = reuse_plan(holes=False)
    g = torch.Generator().manual_seed(seed)
    text = plan.text_mask()
    text[-1] = True
    rows = text.nonzero().flatten()
    observer = PrefillObserver({plan.index: rows})
    observer.queries[plan.index] = {
        layer: torch.randn(rows.numel(), H_Q, D, generator=g) for layer in range(layers)
    }
    observer.hidden_stats[plan.index] = {
        layer: (torch.tensor(0.1), torch.tensor(1.0 + layer), HIDDEN) for layer in range(layers)
    }
    return observer


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("name", sorted(EVICTION_SCORERS))
def test_the_ranker_ranks_on_the_pool_device_without_copying_keys_to_the_host(name, holes):
    plan, observer, pool, table = reuse_plan(holes), _observed(), Pool(2), request_table()
    view = RowView.of(plan)
    assert (view is not None) == holes
    projector = scoring_inputs().project_queries
    ranker = VisualRanker(EVICTION_SCORERS[name](), 0.5, spans_of=lambda p: list(p.images))
    ranker._projector = projector
    expected = ranker.rankings(
        observer, runner(pool, table), batch(False), plan, plan.images, view=view
    )
    with DeviceAudit() as audit:
        ranker._projector = projector.on_device()
        device_observer = PrefillObserver(
            observer.rows, on_device(observer.queries), on_device(observer.hidden_stats)
        )
        model_runner = runner(pool.on_device(), on_device(table))
        rankings = ranker.rankings(
            device_observer, model_runner, batch(True), plan, plan.images, view=view
        )
    assert_on_device(*rankings)
    assert [r.numel() for r in rankings] == [8, 4 if holes else 6]
    for got, want in zip(rankings, expected, strict=True):
        torch.testing.assert_close(host(got), want, rtol=0, atol=0)
    assert audit.downloads == []


# -- per-layer reductions: the scoring pass and the observer --------------------------------

REDUCING = [(r, n) for r, n in SCORERS if r[n]().layer_reduction() is not None]


def test_every_attention_scorer_reduces_layer_by_layer():
    assert sorted(n for _, n in REDUCING) == [
        "aircache",
        "conduit",
        "mmshiftkv",
        "prophetkv",
        "snapkv",
        "staleprobe",
    ]


def _reduced_row() -> ReducedRow:
    """Request 1's text rows (before, between and after the images) and two images."""
    visual = torch.zeros(SEQ, dtype=torch.bool)
    for s, e in SPANS:
        visual[s:e] = True
    return ReducedRow((~visual).nonzero().flatten(), SPANS)


def _reduce(scorer, layers: int, device: bool):
    """Every layer of a pass reduced for request 1 of ``batch``; returns the
    statistics' scoring inputs (select / ranking read those alone) and the audit."""
    g = torch.Generator().manual_seed(3)
    pool, table = Pool(layers), request_table()
    row = _reduced_row()
    queries = [torch.randn(row.query_positions.numel(), H_Q, D, generator=g) for _ in range(layers)]
    stats = [(torch.tensor(0.1 * i), torch.tensor(1.0 + 0.2 * i), HIDDEN) for i in range(layers)]
    projector = scoring_inputs(layers).project_queries
    audit = DeviceAudit()
    if device:
        pool, table, queries, stats = (
            pool.on_device(),
            on_device(table),
            *on_device((queries, stats)),
        )
        projector = projector.on_device()
    with audit if device else contextlib.nullcontext():
        reducer = LayerStatistics(scorer, {1: row}, projector)
        slots = row_slots(SimpleNamespace(req_to_token=table), batch(device), 1)
        for layer in range(layers):
            k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
            reducer.reduce(1, layer, queries[layer], k, v, slots, stats[layer])
        layer_syncs = list(audit.syncs)
        inputs = reducer.inputs(1, k.device)
        chosen, ranking = scorer.select(inputs, BUDGET), scorer.ranking(inputs, BUDGET)
    return inputs, chosen, ranking, audit, layer_syncs


@pytest.mark.parametrize(("registry", "name"), REDUCING, ids=[n for _, n in REDUCING])
def test_a_layer_reduction_runs_on_the_pool_device_without_a_sync(
    registry, name, reference_kernels
):
    """The statistics a pass keeps, and the selection read from them, stay on the
    pool's device; the layers never wait for it and move nothing more with more
    layers (the positions go once)."""
    knobs = {"num_samples": 64, "samples_per_group": 8} if name == "mmshiftkv" else {}
    scorer = registry[name](**knobs)
    want, want_chosen, want_ranking, _, _ = _reduce(scorer, 2, device=False)
    got, chosen, ranking, audit, layer_syncs = _reduce(scorer, 2, device=True)
    assert_on_device(got.layer_statistics, chosen, ranking)
    exact = {"rtol": 0, "atol": 0}
    torch.testing.assert_close(host(got.layer_statistics), want.layer_statistics, **exact)
    assert torch.equal(host(chosen), want_chosen)
    torch.testing.assert_close(host(ranking), want_ranking, **exact)
    assert layer_syncs == []
    *_, more, more_layer_syncs = _reduce(scorer, 4, device=True)
    assert more_layer_syncs == [] and more.uploads - audit.uploads == (
        2 if name == "mmshiftkv" else 0  # its proxies' noise, drawn on the host per layer
    )


def test_the_observer_reduces_each_layer_on_the_device_and_keeps_no_query():
    """A streaming observer: each layer's queries wait for the layer's attention, then
    the row read in place from the pool is reduced and they are dropped."""
    lens = [5, SEQ]
    g = torch.Generator().manual_seed(0)
    row = _reduced_row()
    qs = [torch.randn(5 + SEQ, H_Q * D, generator=g) for _ in range(3)]
    pool, table = Pool(3), request_table()

    def observe(device: bool):
        fb = SimpleNamespace(extend_seq_lens_cpu=lens, **vars(batch(device)))
        backend = SimpleNamespace(
            token_to_kv_pool=pool.on_device() if device else pool,
            req_to_token_pool=SimpleNamespace(req_to_token=on_device(table) if device else table),
        )
        scorer = EVICTION_SCORERS["snapkv"]()
        observer = PrefillObserver(
            {1: row.query_positions}, statistics=LayerStatistics(scorer, {1: row})
        )
        for layer_id, q in enumerate(on_device(qs) if device else qs):
            layer = SimpleNamespace(tp_q_head_num=H_Q, qk_head_dim=D, layer_id=layer_id)
            observer.observe_queries(q, layer, fb)
            observer.observe_attention(layer, fb, backend)
        return observer

    expected = observe(False)
    with DeviceAudit() as audit:
        observer = observe(True)
    assert audit.syncs == [] and observer.queries == {} and observer._pending == {}
    for layer_id in range(3):
        got = observer.statistics.statistics[1][layer_id]
        assert_on_device(got)
        want = expected.statistics.statistics[1][layer_id]
        assert got.shape == (H_KV, sum(e - s for s, e in SPANS))
        torch.testing.assert_close(host(got), want, rtol=0, atol=0)


# -- row compaction -----------------------------------------------------------------------


def test_dropped_positions_follow_the_rankings_device():
    g = torch.Generator().manual_seed(0)
    ranked = {(6, 14): torch.rand(8, generator=g), (18, 24): torch.rand(6, generator=g)}
    with DeviceAudit():
        drop = dropped_positions(0.5, on_device(ranked))
    assert_on_device(drop)
    assert host(drop).tolist() == dropped_positions(0.5, ranked).tolist()


class Allocator:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, slots: torch.Tensor) -> None:
        self.freed += host(slots).tolist()


def _compact(device: bool) -> tuple[torch.Tensor, list[int], list[int]]:
    """Row 2 (request 1) shrinks by its holes and a decode-time drop ranked on the pool's
    device; returns the row, the freed slots and the new seq_lens."""
    plan = replace(reuse_plan(), images=((6, 14),))
    g = torch.Generator().manual_seed(1)
    ranked = {1: {(6, 14): torch.rand(8, generator=g)}}
    req = SimpleNamespace(
        rid="r1",
        kv=SimpleNamespace(req_pool_idx=2, kv_committed_len=SEQ, kv_allocated_len=SEQ),
        multimodal_inputs=SimpleNamespace(
            mrope_positions=None, mrope_position_delta=torch.tensor([[0]])
        ),
        session=None,
        sampling_params=SimpleNamespace(max_new_tokens=8),
        skip_radix_cache_insert=False,
        finished=lambda: False,
        is_retracted=False,
    )
    other = SimpleNamespace(**{**vars(req), "rid": "r0", "multimodal_inputs": None})
    other.kv = SimpleNamespace(req_pool_idx=0, kv_committed_len=5, kv_allocated_len=5)
    sched = SimpleNamespace(
        reqs=[other, req],
        chunked_req=None,
        seq_lens=torch.tensor([5, SEQ]),
        seq_lens_cpu=torch.tensor([5, SEQ]),
        orig_seq_lens=None,
    )
    fb = SimpleNamespace(rids=["r0", "r1"], **vars(batch(device)))
    table, allocator = request_table(), Allocator()
    compactor = RowCompactor(0.5, holes=True)
    compactor.admit(sched)
    if device:
        table, ranked = on_device(table), on_device(ranked)
        sched.seq_lens = on_device(sched.seq_lens)
    compactor.plan_holes(fb, [plan])
    compactor.plan(fb, [plan], ranked)
    compactor.compact(sched, SimpleNamespace(req_to_token=table), allocator)
    return host(table)[2], allocator.freed, host(sched.seq_lens).tolist()


def test_row_compaction_shrinks_a_device_row_with_device_rankings():
    expected = _compact(device=False)
    with DeviceAudit():
        row, freed, seq_lens = _compact(device=True)
    assert row.tolist() == expected[0].tolist() and freed == expected[1]
    assert seq_lens == expected[2] and seq_lens[1] == SEQ - len(freed) and len(freed) == 2 + 4
