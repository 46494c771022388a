"""sgl_mmkv's CPU stand-in for sgl_kernel, checked against SGLang's own semantics."""

from __future__ import annotations

import pytest
import torch

from sgl_mmkv.cpu_support import SHIM_DIR, real_sgl_kernel_installed

pytestmark = pytest.mark.skipif(
    real_sgl_kernel_installed(), reason="the real sgl_kernel is installed; the shim is unused"
)


def test_shim_is_the_imported_sgl_kernel():
    import sgl_kernel

    assert sgl_kernel.IS_SGL_MMKV_CPU_SHIM
    assert SHIM_DIR in __import__("pathlib").Path(sgl_kernel.__file__).resolve().parents


def _pool(dtype: torch.dtype, size: int = 700):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=dtype,
        head_num=2,
        head_dim=8,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
        enable_kv_cache_copy=True,
    )
    generator = torch.Generator().manual_seed(0)
    for buffer in [*pool.k_buffer, *pool.v_buffer]:
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(dtype))
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_locs, overlap",
    [(1, False), (37, False), (37, True), (300, False), (300, True)],
)
def test_move_kv_cache_matches_native_move(dtype, num_locs, overlap):
    """MHATokenToKVPool.move_kv_cache (through the shim) == SGLang's torch move."""
    from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

    pool = _pool(dtype)
    perm = torch.randperm(pool.size, generator=torch.Generator().manual_seed(num_locs)) + 1
    src = perm[:num_locs]
    # Overlap: some targets are also sources, as when a request compacts its row.
    tgt = perm[num_locs // 2 : num_locs // 2 + num_locs] if overlap else perm[num_locs:][:num_locs]
    k_ref = [b.clone() for b in pool.k_buffer]
    v_ref = [b.clone() for b in pool.v_buffer]
    # SGLang moves more than `num_locs_upper` slots chunk by chunk (each chunk
    # read before written, as the GPU kernel does); the reference does the same.
    cap = pool._kv_copy_config["num_locs_upper"]
    for start in range(0, num_locs, cap):
        move_kv_cache_native(k_ref, v_ref, tgt[start : start + cap], src[start : start + cap])

    pool.move_kv_cache(tgt, src)

    for got, want in zip([*pool.k_buffer, *pool.v_buffer], [*k_ref, *v_ref], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_move_kv_cache_rejects_mismatched_lengths():
    from sgl_kernel import copy_all_layer_kv_cache_cpu

    pool = _pool(torch.float32)
    with pytest.raises(ValueError, match="tgt_loc has 2 slots, src_loc 3"):
        copy_all_layer_kv_cache_cpu(
            pool.data_ptrs, pool.data_strides, torch.tensor([1, 2]), torch.tensor([3, 4, 5])
        )


def test_assign_req_to_token_pool_matches_definition():
    from sgl_kernel import assign_req_to_token_pool_cpu

    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    start = torch.tensor([1, 0, 5])
    end = torch.tensor([4, 2, 6])
    out = torch.arange(100, 106, dtype=torch.int32)

    assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out, 10)

    want = torch.zeros(4, 10, dtype=torch.int32)
    want[2, 1:4] = torch.tensor([100, 101, 102])
    want[0, 0:2] = torch.tensor([103, 104])
    want[3, 5:6] = torch.tensor([105])
    assert torch.equal(req_to_token, want)


def test_other_ops_raise_naming_the_op():
    import sgl_kernel

    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.silu_and_mul is not available"):
        sgl_kernel.silu_and_mul(torch.zeros(2, 4), torch.zeros(2, 2))
    with pytest.raises(NotImplementedError, match="fused_sigmoid_mul_cpu"):
        torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(torch.zeros(2), torch.zeros(2))


def test_feature_probes_stay_false():
    """SGLang picks fused CPU paths with hasattr(torch.ops.sgl_kernel, ...): keep them off."""
    import sgl_kernel  # noqa: F401

    assert not hasattr(torch.ops.sgl_kernel, "fused_qk_norm_cpu")
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
