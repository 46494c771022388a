"""Start-up proves every hook sgl_mmkv registered was applied by SGLang's registry
(which only logs a target it could not patch)."""

from __future__ import annotations

import sys

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_mmkv import plugin
from sgl_mmkv.config import MMKVConfig


def test_each_mode_registers_its_patches():
    from sgl_mmkv import patches

    targets = {
        name: [t for m in plugin._patches_for(MMKVConfig(**kw)) for t in plugin.targets_of(m)]
        for name, kw in {
            "off": {},
            "exact": {"mm_reuse": "exact"},
            "conduit": {"mm_reuse": "conduit"},
            "report": {"mm_reuse": "conduit", "mm_report_reuse": True},
        }.items()
    }
    # Every mode a launcher starts has the CPU tensor-parallel hook (inert on a GPU).
    cpu_tp = plugin.targets_of(patches.model_parallel_group_cpu)
    assert targets["off"] == cpu_tp and targets["exact"] == cpu_tp
    assert len(targets["conduit"]) == 10 and len(targets["report"]) == 11
    assert plugin._patches_for(None) == []  # a stock launch: nothing
    weight_updates = [t for t in targets["conduit"] if ".update_weights_from_" in t]
    assert len(weight_updates) == 4  # disk, tensor, distributed, IPC


def test_every_target_names_a_function_of_this_sglang():
    import pkgutil

    from sgl_mmkv import patches

    for name in patches.__all__:
        for target in plugin.targets_of(getattr(patches, name)):
            owner, attribute = target.rsplit(".", 1)
            assert callable(getattr(pkgutil.resolve_name(owner), attribute)), target


def test_a_hook_sglang_did_not_apply_stops_the_start(monkeypatch, tmp_path):
    module = tmp_path / "hook_target_module.py"
    module.write_text("def target(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    applied = "hook_target_module.target"
    missing = "hook_target_module.renamed_in_a_new_release"
    monkeypatch.setattr(plugin, "REGISTERED_TARGETS", [applied])
    monkeypatch.setattr(HookRegistry, "_patched", set(HookRegistry._patched))
    HookRegistry.register(applied, lambda x: None, HookType.BEFORE)
    HookRegistry.register(missing, lambda x: None, HookType.BEFORE)
    try:
        HookRegistry.apply_hooks()  # logs and continues on the missing target
        plugin.verify_hooks()  # the applied one passes
        plugin.REGISTERED_TARGETS.append(missing)
        with pytest.raises(RuntimeError, match="renamed_in_a_new_release"):
            plugin.verify_hooks()
    finally:
        HookRegistry._hooks.pop(applied, None)
        HookRegistry._hooks.pop(missing, None)
        sys.modules.pop("hook_target_module", None)


def _bind(*args, **kwargs) -> dict:
    import inspect

    from sglang.srt.distributed import parallel_state

    target = inspect.unwrap(parallel_state.init_model_parallel_group)
    return inspect.signature(target).bind(*args, **kwargs).arguments


@pytest.mark.parametrize(
    ("device", "group_ranks", "use_pynccl", "acts"),
    [
        ("cpu", [[0, 1]], None, True),
        ("cpu", [[0, 1]], True, True),  # pynccl cannot run on the CPU whoever asks
        ("cpu", [[0, 1]], False, False),
        ("cpu", [[0], [1]], None, False),  # groups of one rank build no communicator
        ("cuda", [[0, 1]], None, False),
    ],
)
def test_cpu_groups_of_several_ranks_skip_pynccl(
    monkeypatch, device, group_ranks, use_pynccl, acts
):
    from sgl_mmkv.patches import model_parallel_group_cpu as hook

    monkeypatch.setattr(hook, "_group_device_type", lambda local_rank: device)
    kwargs = {"group_name": "tp"} if use_pynccl is None else {"use_pynccl": use_pynccl}
    result = hook.gloo_on_cpu(group_ranks, 0, "gloo", **kwargs)
    if not acts:
        assert result is None
        return
    arguments = _bind(*result[0], **result[1])
    assert arguments["use_pynccl"] is False
    assert arguments["group_ranks"] == group_ranks and arguments["backend"] == "gloo"
