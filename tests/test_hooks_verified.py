"""Start-up proves every hook sgl_mmkv registered was applied by SGLang's registry
(which only logs a target it could not patch)."""

from __future__ import annotations

import sys

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_mmkv import plugin
from sgl_mmkv.config import MMKVConfig


def test_each_mode_registers_its_patches():
    targets = {
        name: [t for m in plugin._patches_for(MMKVConfig(**kw)) for t in plugin.targets_of(m)]
        for name, kw in {
            "off": {},
            "exact": {"mm_reuse": "exact"},
            "conduit": {"mm_reuse": "conduit"},
            "report": {"mm_reuse": "conduit", "mm_report_reuse": True},
        }.items()
    }
    assert targets["off"] == [] and targets["exact"] == []
    assert len(targets["conduit"]) == 9 and len(targets["report"]) == 10
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
