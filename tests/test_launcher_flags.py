"""sgl_mmkv's flags: parsing, validation, pass-through, CPU defaults. No server is started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sgl_mmkv.config import CONFIG_ENV, ConfigError, MMKVConfig, active_config, export_config
from sgl_mmkv.launch_server import (
    OMP_BIND_ENV,
    apply_device_defaults,
    bind_cpu_ranks,
    cpu_thread_binding,
    resolve_args,
)


def test_off_passes_stock_flags_through_unchanged():
    config, argv = resolve_args(["--model-path", "m", "--port", "1234", "--page-size", "16"])
    assert config == MMKVConfig(mm_reuse="off", mm_refresh_budget=0.1)
    assert argv == ["--model-path", "m", "--port", "1234", "--page-size", "16"]


def test_refresh_modes_pass_a_page_size_above_one_through():
    for extra in (
        [],
        ["--mm-evict", "snapkv", "--mm-compressed-reuse", "recompute"],
        ["--mm-evict", "snapkv", "--mm-compressed-reuse", "recompute", "--mm-compress-at", "fill"],
    ):
        config, argv = resolve_args(["--mm-reuse", "conduit", *extra, "--page-size", "16"])
        assert config.uses_refresh and argv[argv.index("--page-size") + 1] == "16"


def test_exact_selects_our_radix_cache_backend():
    config, argv = resolve_args(["--model-path", "m", "--mm-reuse", "exact"])
    assert config.mm_reuse == "exact"
    assert argv == ["--model-path", "m", "--radix-cache-backend", "sgl_mmkv"]


def test_no_mode_turns_the_overlap_scheduler_off():
    config, argv = resolve_args(["--mm-reuse", "conduit", "--mm-refresh-budget", "0"])
    assert config.uses_refresh and config.mm_refresh_budget == 0.0
    assert "--disable-overlap-schedule" not in argv
    assert "--disable-overlap-schedule" not in resolve_args(["--mm-reuse", "exact"])[1]
    decode = ["--mm-reuse", "conduit", "--mm-evict", "snapkv", "--mm-compress-at", "decode"]
    assert "--disable-overlap-schedule" not in resolve_args(decode)[1]


def test_budget_is_parsed():
    config, _ = resolve_args(["--mm-reuse=exact", "--mm-refresh-budget=0.25"])
    assert config.mm_refresh_budget == 0.25


def test_auto_budget_is_parsed_for_a_scorer_that_measures_staleness():
    config, argv = resolve_args(["--mm-reuse", "staleprobe", "--mm-refresh-budget", "auto"])
    assert config.mm_refresh_budget == "auto" and "--mm-refresh-budget" not in argv
    assert MMKVConfig.from_json(config.to_json()) == config


def test_scorer_args_reach_the_scorer_and_are_off_by_default():
    knobs = '{"use_value_norm": false, "query_span": "last_text", "layers": [3, 1]}'
    config, argv = resolve_args(["--mm-reuse", "conduit", "--mm-refresh-scorer-args", knobs])
    assert "--mm-refresh-scorer-args" not in argv
    assert config.refresh_scorer_knobs() == {
        "use_value_norm": False,
        "query_span": "last_text",
        "layers": [3, 1],
    }
    assert config.scored_layers == (3, 1)
    assert MMKVConfig.from_json(config.to_json()) == config
    default, _ = resolve_args(["--mm-reuse", "conduit"])
    assert default.refresh_scorer_knobs() == {} and default.scored_layers is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mm-reuse", "bogus"], "--mm-reuse 'bogus' is unknown"),
        (
            ["--mm-refresh-budget", "-0.1"],
            r"--mm-refresh-budget must be in \[0, 1\] or auto, got -0.1",
        ),
        (["--mm-refresh-budget", "1.01"], r"must be in \[0, 1\] or auto, got 1.01"),
        (["--mm-refresh-budget", "nan"], r"must be in \[0, 1\] or auto, got nan"),
        (
            ["--mm-reuse", "conduit", "--mm-refresh-budget", "auto"],
            r"--mm-refresh-budget auto needs a --mm-reuse that measures staleness "
            r"\(staleprobe\), not conduit",
        ),
        (
            [
                "--mm-reuse",
                "staleprobe",
                "--mm-refresh-budget",
                "auto",
                "--mm-refresh-scorer-args",
                '{"auto_fraction": 2.0}',
            ],
            "auto_fraction must be in",
        ),  # fmt: skip
        (
            ["--mm-reuse", "exact", "--radix-cache-backend", "flexkv"],
            "cannot be combined with --radix-cache-backend flexkv",
        ),
        (["--mm-reuse", "exact", "--disable-radix-cache"], "needs the radix cache"),
        (["--mm-reuse", "conduit", "--mm-evict", "h2o"], "--mm-evict 'h2o' is unknown"),
        (["--mm-reuse", "exact", "--mm-evict", "snapkv"], "needs a refresh mode"),
        (
            ["--mm-reuse", "conduit", "--mm-evict", "snapkv", "--mm-kv-budget", "0"],
            r"--mm-kv-budget must be in \(0, 1\], got 0.0",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-evict", "snapkv", "--mm-kv-budget", "1.5"],
            r"--mm-kv-budget must be in \(0, 1\], got 1.5",
        ),
        (["--mm-reuse", "conduit", "--mm-kv-budget", "0.2"], "need a scored --mm-evict"),
        (["--mm-reuse", "conduit", "--mm-compress-at", "decode"], "need a scored --mm-evict"),
        (
            ["--mm-reuse", "conduit", "--mm-evict", "aircache", "--mm-compress-at", "now"],
            "--mm-compress-at 'now' is unknown",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-evict", "aircache", "--page-size", "4"],
            "with rows that shrink after prefill .* needs --page-size 1, got --page-size 4",
        ),
        (
            [
                "--mm-reuse",
                "conduit",
                "--mm-evict",
                "snapkv",
                "--mm-compress-at",
                "decode",
                "--mm-compressed-reuse",
                "recompute",
                "--page-size",
                "16",
            ],
            "needs --page-size 1, got --page-size 16; or set --mm-compressed-reuse recompute",
        ),  # fmt: skip
        (["--mm-reuse", "conduit", "--mm-reuse-gate", "never"], "--mm-reuse-gate 'never'"),
        (["--mm-reuse", "exact", "--mm-reuse-gate", "always"], "needs a refresh mode"),
        (
            ["--mm-reuse", "exact", "--mm-segment-storage", "file"],
            "--mm-segment-storage file stores segments of the segment store and needs a refresh",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-segment-storage", "file"],
            "needs --mm-segment-storage-dir",
        ),
        (["--mm-reuse", "conduit", "--mm-segment-storage", "a/b"], "must be a backend name"),
        (
            ["--mm-reuse", "conduit", "--mm-segment-storage-dir", "/tmp/x"],
            "need --mm-segment-storage",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-segment-storage", "mooncake"]
            + ["--mm-segment-storage-config", "[1]"],
            "must be a JSON object",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-segment-storage", "mooncake"]
            + ["--mm-segment-storage-config", "{bad"],
            "--mm-segment-storage-config is not JSON",
        ),
        (
            ["--mm-reuse", "exact", "--mm-refresh-scorer-args", '{"layers": [0]}'],
            "--mm-refresh-scorer-args needs a refresh mode of --mm-reuse, not exact",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-refresh-scorer-args", '{"alpha": 1}'],
            "conduit has no knob 'alpha' \\(its knobs: amplification, use_value_norm, query_span",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-refresh-scorer-args", '{"use_value_norm": "no"}'],
            "knob 'use_value_norm' takes a value like True, got 'no'",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-refresh-scorer-args", '{"query_span": "all"}'],
            "query_span 'all' is unknown; choose one of tail_text, last_text",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-refresh-scorer-args", '{"layers": []}'],
            "layers must be a non-empty list of layer ids",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-refresh-scorer-args", '{"layers": [1.5]}'],
            "layers must be a non-empty list of layer ids",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-refresh-scorer-args", '{"amplification": -1}'],
            "amplification must be >= 0",
        ),
        (["--mm-reuse", "conduit", "--mm-refresh-scorer-args", "[1]"], "must be a JSON object"),
        (["--mm-reuse", "conduit", "--mm-refresh-scorer-args", "{x"], "not JSON"),
        (
            ["--mm-reuse", "random", "--mm-refresh-scorer-args", '{"seed": 0.5}'],
            "knob 'seed' takes a value like 0, got 0.5",
        ),
        (
            ["--mm-reuse", "first", "--mm-refresh-scorer-args", '{"seed": 1}'],
            "first has no knob 'seed' \\(its knobs: none\\)",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-embeddings-max-gib", "-1"],
            "--mm-embeddings-max-gib must be a size in GiB >= 0, got -1.0",
        ),
        (
            ["--mm-reuse", "conduit", "--mm-embeddings-max-gib", "inf"],
            "--mm-embeddings-max-gib must be a size in GiB >= 0, got inf",
        ),
        (
            ["--mm-reuse", "exact", "--mm-embeddings-max-gib", "2"],
            "--mm-embeddings-max-gib needs a refresh mode of --mm-reuse .*, not exact",
        ),
    ],
)
def test_bad_flags_raise_config_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        resolve_args(argv)


def test_the_embeddings_cap_reaches_the_segment_store():
    from types import SimpleNamespace

    import torch

    from sgl_mmkv.assembly import assemble_runtime

    for gib, cap in ((1.0, 2**30), (0.25, 2**28), (0.0, 0)):
        config, _ = resolve_args(["--mm-reuse", "conduit", "--mm-embeddings-max-gib", str(gib)])
        buffer = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
        pool = SimpleNamespace(
            device=torch.device("cpu"),
            dtype=torch.bfloat16,
            get_key_buffer=lambda layer, b=buffer: b,
            get_value_buffer=lambda layer, b=buffer: b,
        )
        allocator = SimpleNamespace(get_kvcache=lambda pool=pool: pool)
        cache = SimpleNamespace(
            page_size=1, token_to_kv_pool_allocator=allocator, publish_metrics=None, metrics=None
        )
        assert assemble_runtime(config, cache, "m").store.embeddings_max_bytes == cap


def test_eviction_flags_are_parsed_and_match_the_scorer_registry():
    from sgl_mmkv.config import EVICTION_POLICIES
    from sgl_mmkv.scoring import make_eviction_scorer

    # the documented choices (docs/usage.md, docs/design.md), each scored one a built scorer
    assert list(EVICTION_POLICIES) == ["lru", "aircache", "mmshiftkv", "snapkv", "random_keep"]
    scored = list(EVICTION_POLICIES)[1:]
    assert [make_eviction_scorer(name).name for name in scored] == scored
    config, _ = resolve_args(
        ["--mm-reuse", "conduit", "--mm-evict", "mmshiftkv", "--mm-kv-budget", "0.1"]
    )
    assert config.mm_evict == "mmshiftkv" and config.mm_kv_budget == 0.1
    assert config.uses_scored_eviction and config.mm_compress_at == "pressure"
    assert not resolve_args(["--mm-reuse", "conduit"])[0].uses_scored_eviction
    decode, _ = resolve_args(
        ["--mm-reuse", "conduit", "--mm-evict", "snapkv", "--mm-compress-at", "decode"]
    )
    assert decode.compresses_at_decode and not config.compresses_at_decode


def test_reuse_gate_defaults_to_cost_and_parses_always():
    assert resolve_args(["--mm-reuse", "conduit"])[0].mm_reuse_gate == "cost"
    config, argv = resolve_args(["--mm-reuse", "conduit", "--mm-reuse-gate", "always"])
    assert config.mm_reuse_gate == "always" and "--mm-reuse-gate" not in argv


def test_plugin_allow_list_must_include_us(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    with pytest.raises(ConfigError, match="excludes the sgl_mmkv plugin"):
        resolve_args(["--mm-reuse", "exact"])
    assert resolve_args(["--mm-reuse", "off"])[0].mm_reuse == "off"
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else, sgl_mmkv")
    assert resolve_args(["--mm-reuse", "exact"])[0].mm_reuse == "exact"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mm-reuse", "bogus"], "--mm-reuse 'bogus' is unknown; choose one of off, exact"),
        (["--mm-refresh-budget", "2"], "--mm-refresh-budget must be in [0, 1] or auto, got 2.0"),
        (["--mm-refresh-budget", "abc"], "must be a number in [0, 1] or auto, got 'abc'"),
    ],
)
def test_cli_exits_2_with_clear_message(flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "sgl_mmkv.launch_server", "--model-path", "x", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_our_flags_then_stock_ones():
    result = subprocess.run(
        [sys.executable, "-m", "sgl_mmkv.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    assert "--mm-refresh-budget" in result.stdout
    assert "--radix-cache-backend" in result.stdout


def test_cpu_defaults_only_when_missing():
    assert apply_device_defaults([], cuda=False) == [
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
    ]
    assert apply_device_defaults(["--attention-backend", "intel_amx"], cuda=False) == [
        "--attention-backend",
        "intel_amx",
        "--device",
        "cpu",
    ]
    assert apply_device_defaults([], cuda=True) == []


def test_config_round_trips_through_the_environment(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert active_config() is None
    config = MMKVConfig(mm_reuse="exact", mm_refresh_budget=0.5)
    export_config(config)
    assert active_config() == config
    monkeypatch.setenv(CONFIG_ENV, "{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        active_config()


def test_every_registered_scorer_is_a_launcher_choice():
    from sgl_mmkv.launch_server import build_parser
    from sgl_mmkv.scoring import EVICTION_SCORERS, REFRESH_SCORERS

    for name in REFRESH_SCORERS:
        assert resolve_args(["--mm-reuse", name])[0].mm_reuse == name
    for name in EVICTION_SCORERS:
        config, _ = resolve_args(["--mm-reuse", "conduit", "--mm-evict", name])
        assert config.mm_evict == name and config.uses_scored_eviction
    usage = build_parser().format_usage().replace("\n", "").replace(" ", "")
    assert "--mm-reuse{off,exact," + ",".join(REFRESH_SCORERS) + "}" in usage
    assert "--mm-evict{lru," + ",".join(EVICTION_SCORERS) + "}" in usage


def test_segment_storage_is_off_by_default_and_parsed():
    config, argv = resolve_args(["--mm-reuse", "conduit"])
    assert config.mm_segment_storage == "none" and not config.uses_segment_storage
    config, argv = resolve_args(
        ["--mm-reuse", "conduit", "--mm-segment-storage", "file"]
        + [
            "--mm-segment-storage-dir",
            "/tmp/l3",
            "--mm-segment-storage-config",
            '{"max_size": "1G"}',
        ]
    )
    assert config.uses_segment_storage and config.mm_segment_storage_dir == "/tmp/l3"
    assert config.storage_extra_config() == {"max_size": "1G"}
    assert not any(a.startswith("--mm-") for a in argv)
    assert MMKVConfig.from_json(config.to_json()) == config


def test_storage_backend_names_come_from_sglang_factory():
    from sgl_mmkv.support import check_storage_backend

    for name in ("file", "mooncake", "hf3fs", "nixl"):
        check_storage_backend(name)
    with pytest.raises(ConfigError, match="'nosuch' is unknown; choose none or one of .*file"):
        check_storage_backend("nosuch")


@pytest.mark.parametrize(
    "backend, message",
    [
        ("sim", "--mm-segment-storage sim: SimHiCacheStorage returned other bytes"),
        ("nosuch", "--mm-segment-storage 'nosuch' is unknown; choose none or one of"),
    ],
)
def test_cli_refuses_a_storage_backend_that_cannot_keep_segments(
    tiny_vlm, tmp_path, backend, message
):
    result = subprocess.run(
        [sys.executable, "-m", "sgl_mmkv.launch_server", "--model-path", str(tiny_vlm)]
        + ["--mm-reuse", "conduit", "--mm-segment-storage", backend]
        + ["--mm-segment-storage-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_cpu_ranks_split_the_cores():
    assert cpu_thread_binding(2, [1, 0]) == "0|1"
    assert cpu_thread_binding(2, list(range(8))) == "0-3|4-7"
    assert cpu_thread_binding(3, list(range(8))) == "0-2|3-5|6-7"
    assert cpu_thread_binding(2, [0, 2, 4, 6]) == "0,2|4,6"
    assert cpu_thread_binding(4, [0, 1]) == "0|1|0|1"  # fewer cores than ranks: shared


def test_cpu_binding_is_set_only_for_several_cpu_ranks_the_user_left_unbound(monkeypatch):
    from types import SimpleNamespace

    def args(device="cpu", tp=2, pp=1, dp=1):
        return SimpleNamespace(device=device, tp_size=tp, pp_size=pp, dp_size=dp)

    monkeypatch.delenv(OMP_BIND_ENV, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert bind_cpu_ranks(args(tp=1)) is None and OMP_BIND_ENV not in os.environ
    assert bind_cpu_ranks(args(device="cuda")) is None and OMP_BIND_ENV not in os.environ
    line = bind_cpu_ranks(args())
    assert os.environ[OMP_BIND_ENV] == "0|1"
    assert "2 CPU ranks" in line and "NUMA" in line
    monkeypatch.setenv(OMP_BIND_ENV, "1|0")
    assert bind_cpu_ranks(args()) is None and os.environ[OMP_BIND_ENV] == "1|0"
