"""fp8 KV with per-tensor scales through SGLang's own pool, against a float32 reference.

SGLang's fp8 pool (``MHATokenToKVPool`` with ``--kv-cache-dtype fp8_e4m3`` /
``fp8_e5m2``, built here on the CPU: only its attention backends need AMX) stores
``value / scale`` as fp8 bytes, one K and one V scale per layer. The kernels alone
are checked in ``tests/test_fp8_kernels.py`` (no SGLang, so a GPU machine runs it).
Here:

- a segment copy over SGLang's pool rotates its fp8 bytes in place within one fp8
  rounding of the float32 rotation;
- the refresh backend writes new K/V with the layer's scales (as SGLang's
  scale-aware backends do) and its attention reads the row back descaled;
- scoring reads (``kv_at``, ``row_kv``) and a layer reduction (CONDUIT's) see
  values, not stored numbers;
- the L3 fingerprint names the KV dtype and the scales, so entries of other scales
  or another dtype never load;
- a pool with per-token / per-block scales is refused, a per-tensor fp8 pool is not.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sgl_mmkv.config import ConfigError
from sgl_mmkv.kernels.gather_rotate import rope_inv_freq, rotate_neox
from sgl_mmkv.kernels.reference import scattered_attention_reference
from sgl_mmkv.refresh.attention_backend import RefreshAttentionBackend
from sgl_mmkv.refresh.kv_copy import SegmentCopier
from sgl_mmkv.refresh.kv_scales import KVScales, read_scales
from sgl_mmkv.refresh.layer_statistics import LayerStatistics, ReducedRow
from sgl_mmkv.refresh.plan import RequestPlan, ReuseSpan
from sgl_mmkv.refresh.row_kv import kv_at, row_kv
from sgl_mmkv.scoring import REFRESH_SCORERS
from sgl_mmkv.segments.entry_format import KVFingerprint, max_payload_bytes
from sgl_mmkv.segments.key import Namespace, SegmentKey
from sgl_mmkv.segments.storage import StoredSegment, open_storage
from sgl_mmkv.segments.store import Segment
from sgl_mmkv.support import check_pool_dtype
from sgl_mmkv.testing.stand_ins import extend_batch

TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# one rounding to the nearest fp8 value: half a unit in the last place, relative
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
H_Q, H_KV, D = 4, 2, 16
K_SCALE, V_SCALE = 0.37, 2.5


def _pool(dtype: torch.dtype, slots: int = 64, layers: int = 2) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=slots,
        page_size=1,
        dtype=dtype,
        head_num=H_KV,
        head_dim=D,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def _layer(layer_id: int = 0, k_scale: float = K_SCALE, v_scale: float = V_SCALE):
    """A ``RadixAttention`` as the pool and the refresh backend read it."""
    return SimpleNamespace(
        layer_id=layer_id,
        tp_q_head_num=H_Q,
        tp_k_head_num=H_KV,
        tp_v_head_num=H_KV,
        qk_head_dim=D,
        v_head_dim=D,
        scaling=D**-0.5,
        k_scale=torch.tensor(k_scale),
        v_scale=torch.tensor(v_scale),
        k_scale_float=k_scale,
        v_scale_float=v_scale,
    )


def _fill(pool, layer, slots: torch.Tensor, g: torch.Generator, spread: float = 1.0):
    """Write random K/V (float32 values) at ``slots`` as SGLang's scale-aware backends
    do (``set_kv_buffer`` with the layer's scales); returns the values written."""
    n = slots.numel()
    k = torch.randn(n, H_KV, D, generator=g) * spread
    v = torch.randn(n, H_KV, D, generator=g) * spread
    pool.set_kv_buffer(layer, slots, k.clone(), v.clone(), layer.k_scale_float, layer.v_scale_float)
    return k, v


def _values(pool, layer_id: int, scales=(K_SCALE, V_SCALE)) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's layer as float32 values (stored * scale): the reference's KV."""
    k = pool.get_key_buffer(layer_id).float() * scales[0]
    v = pool.get_value_buffer(layer_id).float() * scales[1]
    return k, v


@pytest.mark.parametrize("dtype", FP8)
def test_a_segment_copy_rotates_the_pools_fp8_bytes_in_place(dtype, monkeypatch):
    """The copier over SGLang's pool: the reused span's K within one fp8 rounding of
    the float32 rotation of the segment's values, V byte for byte, nothing else moved."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch path (CPU)
    g = torch.Generator().manual_seed(6)
    pool = _pool(dtype)
    for layer in (_layer(0), _layer(1)):
        _fill(pool, layer, torch.arange(40, 48), g)
    table = torch.zeros(2, 20, dtype=torch.int32)
    table[1, :16] = torch.arange(16, dtype=torch.int32)
    segment = Segment(("a", 8), torch.arange(40, 48), torch.arange(8)[None])
    visual = torch.zeros(14, dtype=torch.bool)
    visual[4:12] = True
    plan = RequestPlan(0, 2, 16, (ReuseSpan(6, 14, segment, 6),), (), visual, ((6, 14),))
    copier = SegmentCopier()
    copier._rates = rope_inv_freq(D, 1e4)  # as rope_rates_of reads them
    untouched = pool.k_buffer[0][:6].clone()
    runner = SimpleNamespace(
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=table), model=None
    )
    copier.copy(runner, SimpleNamespace(req_pool_indices=torch.tensor([1])), [plan])
    ulp = 2.0 ** -(MANTISSA_BITS[dtype] + 1)
    tiny = torch.finfo(dtype).smallest_normal * K_SCALE
    for layer in range(2):
        k_vals, _ = _values(pool, layer)
        want = rotate_neox(k_vals[40:48], torch.full((8,), 6), copier._rates)
        error = (k_vals[6:14] - want).abs()
        assert bool((error <= ulp * want.abs() + tiny).all()), float(error.max())
        assert torch.equal(pool.v_buffer[layer][6:14], pool.v_buffer[layer][40:48])
    assert torch.equal(pool.k_buffer[0][:6], untouched)


@pytest.mark.parametrize("dtype", FP8)
def test_the_refresh_backend_writes_with_the_scales_and_reads_them_back(dtype):
    """A pass over a row whose first 12 tokens are in the pool: its 8 new tokens'
    K/V go into the pool as ``value / scale`` (what SGLang's triton / flashinfer
    backends store), and their attention reads the whole row descaled."""
    g = torch.Generator().manual_seed(3)
    pool, layer = _pool(dtype), _layer()
    row = torch.randperm(64, generator=g)[:20]
    _fill(pool, layer, row[:12], g)
    table = torch.zeros(2, 24, dtype=torch.int32)
    table[1, :20] = row.to(torch.int32)
    batch = extend_batch([20], [8], [1], row[12:])
    backend = RefreshAttentionBackend(
        SimpleNamespace(req_to_token=table), pool, [torch.arange(12, 20)]
    )
    q = torch.randn(8, H_Q * D, generator=g)
    k_new, v_new = torch.randn(8, H_KV, D, generator=g), torch.randn(8, H_KV, D, generator=g)
    k_in, v_in = k_new.clone(), v_new.clone()
    out = backend.forward_extend(q, k_new, v_new, layer, batch).view(8, H_Q, D)
    assert torch.equal(k_new, k_in) and torch.equal(v_new, v_in)  # the caller's K/V kept
    k_vals, v_vals = _values(pool, 0)
    ulp = 2.0 ** -(MANTISSA_BITS[dtype] + 1)
    tiny = torch.finfo(dtype).smallest_normal * K_SCALE
    assert bool(((k_vals[row[12:]] - k_new).abs() <= ulp * k_new.abs() + tiny).all())
    want = scattered_attention_reference(
        q.view(8, H_Q, D), k_vals, v_vals, row, torch.arange(12, 20)
    )
    torch.testing.assert_close(out, want, rtol=0, atol=2e-5)


# -- scoring reads --------------------------------------------------------------------


def _runner(pool, table, layers):
    model = torch.nn.Module()
    model.attn = torch.nn.ModuleList()
    for layer in layers:
        module = torch.nn.Module()
        module.layer_id, module.k_scale_float = layer.layer_id, layer.k_scale_float
        module.v_scale_float = layer.v_scale_float
        model.attn.append(module)
    return SimpleNamespace(
        token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=table), model=model
    )


def test_scoring_reads_see_values_with_each_layers_scales():
    g = torch.Generator().manual_seed(4)
    pool = _pool(torch.float8_e4m3fn)
    layers = [_layer(0, 0.5, 3.0), _layer(1, 2.0, 0.25)]
    row = torch.randperm(64, generator=g)[:10]
    for layer in layers:
        _fill(pool, layer, row, g)
    table = torch.zeros(1, 12, dtype=torch.int32)
    table[0, :10] = row.to(torch.int32)
    runner = _runner(pool, table, layers)
    batch = SimpleNamespace(
        req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([10]), seq_lens_cpu=None
    )
    keys, values = row_kv(runner, batch, 0)
    scales = read_scales(runner.model, pool)
    for layer in layers:
        i, pair = layer.layer_id, (layer.k_scale_float, layer.v_scale_float)
        k_vals, v_vals = _values(pool, i, pair)
        assert torch.equal(keys[i], k_vals[row]) and torch.equal(values[i], v_vals[row])
        k, v = kv_at(pool, i, row[:3], scales)
        assert torch.equal(k, k_vals[row[:3]]) and torch.equal(v, v_vals[row[:3]])
    assert scales.scales == {0: (0.5, 3.0), 1: (2.0, 0.25)}


def test_a_layer_reduction_reads_an_fp8_row_as_values():
    """CONDUIT's per-layer statistic over the fp8 pool with its scales equals the one
    over the float32 values of the same KV (and not the one over the stored numbers)."""
    g = torch.Generator().manual_seed(7)
    pool, layer = _pool(torch.float8_e4m3fn), _layer()
    row = torch.randperm(64, generator=g)[:24]
    _fill(pool, layer, row, g)
    k_vals, v_vals = _values(pool, 0)
    queries = torch.randn(6, H_Q, D, generator=g)
    reduced = ReducedRow(torch.tensor([2, 3, 18, 19, 22, 23]), ((4, 18),))
    stats = []
    for k, v, scales in (
        (pool.get_key_buffer(0), pool.get_value_buffer(0), (K_SCALE, V_SCALE)),
        (k_vals, v_vals, (1.0, 1.0)),
        (pool.get_key_buffer(0), pool.get_value_buffer(0), (1.0, 1.0)),
    ):
        reducer = LayerStatistics(REFRESH_SCORERS["conduit"](), {0: reduced})
        reducer.reduce(0, 0, queries, k, v, row, scales=scales)
        stats.append(reducer.statistics[0][0])
    torch.testing.assert_close(stats[0], stats[1], rtol=1e-5, atol=1e-7)
    assert float((stats[2] - stats[1]).abs().max()) > 1e-3


def test_a_plain_pool_reads_no_scales():
    pool = _pool(torch.bfloat16)
    layer = _layer(0, 0.5, 3.0)
    scales = read_scales(_runner(pool, torch.zeros(1, 1), [layer]).model, pool)
    assert scales.scales == {} and scales.k(0) == 1.0 and scales.digest() == ""


# -- the L3 fingerprint ---------------------------------------------------------------


def _fingerprint(dtype, scales: dict[int, tuple[float, float]]) -> KVFingerprint:
    pool = _pool(dtype, layers=2)
    digest = KVScales(str(pool.get_key_buffer(0).dtype), scales).digest()
    return KVFingerprint.of_pool(pool, "model", kv_scales=digest)


def test_the_fingerprint_names_the_kv_dtype_and_scales():
    base = _fingerprint(torch.float8_e4m3fn, {0: (0.5, 2.0), 1: (1.0, 1.0)})
    assert base.dtype == "torch.float8_e4m3fn" and len(base.kv_scales) == 16
    assert base == _fingerprint(torch.float8_e4m3fn, {0: (0.5, 2.0), 1: (1.0, 1.0)})
    others = [
        _fingerprint(torch.float8_e4m3fn, {0: (0.5, 2.0), 1: (1.0, 1.5)}),  # one V scale
        _fingerprint(torch.float8_e4m3fn, {0: (0.5000001, 2.0), 1: (1.0, 1.0)}),
        _fingerprint(torch.float8_e5m2, {0: (0.5, 2.0), 1: (1.0, 1.0)}),
        _fingerprint(torch.bfloat16, {}),
    ]
    assert all(other != base for other in others)
    assert len({o.kv_scales for o in others[:3]} | {base.kv_scales}) == 4
    assert others[3].kv_scales == ""


def test_an_entry_of_other_scales_or_dtype_never_loads(tmp_path):
    key = SegmentKey(Namespace("", None), bytes(32), "image", (1, 2, 2), 4)
    fp = _fingerprint(torch.float8_e4m3fn, {0: (0.5, 2.0), 1: (1.0, 1.0)})
    g = torch.Generator().manual_seed(5)
    stored = StoredSegment(
        torch.arange(4)[None],
        None,
        None,
        torch.randn(2, 4, H_KV, D, generator=g).to(torch.float8_e4m3fn),
        torch.randn(2, 4, H_KV, D, generator=g).to(torch.float8_e4m3fn),
    )
    assert open_storage("file", fp, directory=str(tmp_path)).save(key, stored)
    got = open_storage("file", fp, directory=str(tmp_path)).load(key)
    assert got is not None and got.keys.dtype == torch.float8_e4m3fn
    assert torch.equal(got.keys.view(torch.uint8), stored.keys.view(torch.uint8))
    assert torch.equal(got.values.view(torch.uint8), stored.values.view(torch.uint8))
    for other in (
        _fingerprint(torch.float8_e4m3fn, {0: (0.5, 2.0), 1: (1.0, 1.5)}),
        _fingerprint(torch.float8_e5m2, {0: (0.5, 2.0), 1: (1.0, 1.0)}),
    ):
        assert open_storage("file", other, directory=str(tmp_path)).load(key) is None
    # sizes are checked with the stored element size: one byte per fp8 element
    bf16 = _fingerprint(torch.bfloat16, {})
    kv_elements = 2 * 4 * H_KV * 2 * D  # layers x tokens x heads x (K + V) dims
    assert max_payload_bytes(key, bf16) - max_payload_bytes(key, fp) == kv_elements


# -- what is refused ------------------------------------------------------------------


def test_a_per_tensor_fp8_pool_is_accepted_and_a_block_scaled_one_refused():
    for dtype in FP8:
        check_pool_dtype("--mm-reuse conduit", _pool(dtype))
    block_scaled = _pool(torch.float8_e4m3fn)
    block_scaled.k_scale_buffer = [torch.ones(65, H_KV, D // 32 or 1)]  # as MXFP8's pool
    with pytest.raises(ConfigError) as refusal:
        check_pool_dtype("--mm-reuse conduit", block_scaled)
    message = str(refusal.value)
    assert "per-token / per-block scales" in message and "\n" not in message
