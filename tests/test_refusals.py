"""What the refresh path does not support is refused before the server starts: the
launcher exits with status 2 and one line naming the flag or the model, and the
scheduler refuses the same on a stock launch. Both read SGLang's effective
configuration (resolved server args and CUDA graphs, the HF config after overrides)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch

from sgl_mmkv.config import CONFIG_ENV, ConfigError, MMKVConfig
from sgl_mmkv.launch_server import resolve_args
from sgl_mmkv.support import (
    check_effective,
    check_model,
    check_scored_layers,
    graph_backend,
    rope_type,
)
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess, stock_cpu_env

GRAPHS = ["--attention-backend", "intel_amx"]
TORCH_NATIVE = ["--attention-backend", "torch_native"]  # ignores them
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [4.0]}
# (case, extra flags, what the one-line reason must name)
FLAG_CASES = [
    ("tensor parallel, KV heads", ["--tp-size", "3"], "--tp-size 3: the model's 2 KV heads"),
    ("data parallel", ["--dp-size", "2"], "--dp-size 2"),
    ("dp attention", ["--enable-dp-attention", "--dp-size", "2"], "--enable-dp-attention"),
    ("pipeline parallel", ["--pp-size", "2"], "--pp-size 2"),
    ("speculative", ["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE"),
    ("lora", ["--enable-lora"], "--enable-lora"),
    ("lora paths", ["--lora-paths", "a=/nonexistent"], "--lora-paths"),
    (
        "fp8 kv on torch_native",  # the launcher's CPU default, which ignores KV scales
        ["--kv-cache-dtype", "fp8_e4m3"],
        "--kv-cache-dtype fp8_e4m3 with the torch_native attention backend",
    ),
    (
        "block-scaled kv",
        ["--kv-cache-dtype", "mxfp8"],
        "--kv-cache-dtype mxfp8: its KV keeps per-token / per-block scales",
    ),
    ("embedding server", ["--is-embedding"], "--is-embedding: an embedding pooled over reused"),
    # SGLang keeps CUDA graphs on the CPU with a backend other than torch_native
    ("prefill graphs", GRAPHS + ["--cuda-graph-backend-prefill", "full"], "prefill CUDA graphs"),
    (
        "prefill graphs by --cuda-graph-config",
        GRAPHS + ["--cuda-graph-config", '{"prefill": {"backend": "full"}}'],
        "SGLang resolved the prefill backend to 'full'",
    ),
    (
        "decode graphs + reuse with holes",
        GRAPHS + ["--mm-evict", "snapkv"],
        "decode CUDA graphs (SGLang resolved the decode backend to 'full') with rows that "
        "shrink after prefill: replay over shrunk rows is untested; add "
        "--disable-decode-cuda-graph",
    ),
    ("PD disaggregation", ["--disaggregation-mode", "prefill"], "--disaggregation-mode prefill"),
    (
        "sliding window by --json-model-override-args",
        ["--json-model-override-args", json.dumps({"text_config": {"use_sliding_window": True}})],
        "does not support Qwen2VLForConditionalGeneration with a sliding window",
    ),
    (
        "longrope by --json-model-override-args",
        ["--json-model-override-args", json.dumps({"text_config": {"rope_parameters": LONGROPE}})],
        "with longrope rotary scaling",
    ),
    (
        "mixed chunk + decode compression",
        ["--enable-mixed-chunk", "--mm-evict", "snapkv", "--mm-compress-at", "decode"],
        "--enable-mixed-chunk",
    ),
    (
        "mixed chunk + reuse with holes",
        ["--enable-mixed-chunk", "--mm-evict", "snapkv"],
        "--enable-mixed-chunk",
    ),
    ("abbreviated flag", ["--disable-radix"], "--disable-radix-cache"),
    ("hicache", ["--enable-hierarchical-cache"], "--enable-hierarchical-cache (HiCache): rows"),
    (
        "hicache with storage",
        ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
        "--enable-hierarchical-cache (HiCache): rows built from refreshed",
    ),
    ("lmcache", ["--enable-lmcache"], "--enable-lmcache: SGLang ignores it"),
    ("flexkv", ["--enable-flexkv"], "--enable-flexkv: SGLang ignores it"),
    (
        "external cache linker",
        ["--enable-unified-cache-external-linker"],
        "--enable-unified-cache-external-linker",
    ),
    ("hidden states", ["--enable-return-hidden-states"], "--enable-return-hidden-states"),
    (
        "hidden states full",
        ["--return-hidden-states-mode", "full"],
        "--enable-return-hidden-states (every prompt row",
    ),
]


def _argv(model, extra: list[str]) -> list[str]:
    return ["--model-path", str(model), "--mm-reuse", "conduit", *extra]


def _launch(argv: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Run the launcher until it exits. One that is not refused starts a server: its
    whole process tree is ended at ``timeout_s`` and the result has no return code."""
    command = [sys.executable, "-m", "sgl_mmkv.launch_server", *argv]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=stock_cpu_env()
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
        for child in tree:
            child.kill()
        out, err = proc.communicate()
        return subprocess.CompletedProcess(command, None, out, err + "\n(not refused: killed)")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _probe(argvs: list[list[str]], out: Path) -> list[subprocess.CompletedProcess]:
    """The launcher's ``main`` on each of ``argvs`` (one sgl_mmkv configuration) in one
    process (tests/launch_probe.py): its return code and stderr for each."""
    script = Path(__file__).with_name("launch_probe.py")
    done = subprocess.run(
        [sys.executable, str(script), str(out)],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        env=stock_cpu_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [
        subprocess.CompletedProcess(argv, r["returncode"], "", r["stderr"])
        for argv, r in zip(argvs, json.loads(out.read_text()), strict=True)
    ]


@pytest.fixture(scope="module")
def longrope_llava(tiny_llava, tmp_path_factory):
    """The tiny LLaVA's files with LongRoPE rotary scaling in its text config (a
    Qwen2-VL config's rotary is reset to M-RoPE by transformers when it loads)."""
    out = tmp_path_factory.mktemp("longrope") / "tiny-hf-lv-longrope"
    shutil.copytree(tiny_llava, out)
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    text["rope_parameters"] = {
        **text.get("rope_parameters", {}),
        **{"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [4.0] * half},
        "original_max_position_embeddings": 256,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


# Refused in a launcher process of their own as well as in the shared probe.
IN_OWN_PROCESS = ["tensor parallel, KV heads", "longrope model"]


@pytest.fixture(scope="module")
def launches(tiny_vlm, tiny_llm, longrope_llava, tmp_path_factory):
    """Every refused start-up, through the launcher's ``main`` in one process per sgl_mmkv
    configuration (importing SGLang is what a refused start-up costs), and the cases of
    ``IN_OWN_PROCESS`` through ``python -m sgl_mmkv.launch_server`` each, two at a time.
    Returns ``(in the probe, in their own process)`` by case name."""
    runs = {name: _argv(tiny_vlm, extra) for name, extra, _ in FLAG_CASES}
    runs["text-only model"] = _argv(tiny_llm, [])
    runs["longrope model"] = _argv(longrope_llava, [])
    groups: dict[str, list[str]] = {}
    for name, argv in runs.items():
        groups.setdefault(repr(resolve_args(argv)[0]), []).append(name)
    outs = tmp_path_factory.mktemp("launch-probe")
    with ThreadPoolExecutor(2) as pool:
        probes = {
            tuple(names): pool.submit(_probe, [runs[n] for n in names], outs / f"{i}.json")
            for i, names in enumerate(groups.values())
        }
        own = {name: pool.submit(_launch, runs[name]) for name in IN_OWN_PROCESS}
        probed = {
            name: done
            for names, future in probes.items()
            for name, done in zip(names, future.result(), strict=True)
        }
        return probed, {name: future.result() for name, future in own.items()}


def _refused(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, done.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(("name", "extra", "named"), FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_an_unsupported_flag_is_refused_with_its_name(launches, name, extra, named):
    line = _refused(launches[0][name])
    assert named in line and "--mm-reuse conduit" in line


def test_a_text_only_model_is_refused(launches):
    line = _refused(launches[0]["text-only model"])
    assert "does not support Qwen2ForCausalLM" in line and "--mm-reuse exact or off" in line


def test_a_rotary_not_linear_in_position_is_refused(launches):
    line = _refused(launches[0]["longrope model"])
    assert "longrope rotary scaling" in line and "not linear in position" in line


@pytest.mark.parametrize("name", IN_OWN_PROCESS)
def test_the_launcher_process_exits_2_with_the_same_line(launches, name):
    """``python -m sgl_mmkv.launch_server`` exits with status 2 and prints one error
    line, the one its ``main`` gives in the shared probe."""
    probed, own = launches
    assert _refused(own[name]) == _refused(probed[name])


# Stock `sglang.launch_server` with sgl_mmkv's config in the environment: the
# launcher's checks never run, the cache factory in the scheduler refuses.
# (case, sgl_mmkv config, stock flags, the reason the scheduler gives)
SCHEDULER_CASES = [
    (
        "page size with reuse holes",
        {"mm_reuse": "conduit", "mm_evict": "snapkv"},
        ["--page-size", "16"],
        "page size 16 (--page-size, or forced by the attention backend torch_native) with rows",
    ),
    (
        "sliding window by --json-model-override-args",
        {"mm_reuse": "conduit"},
        ["--json-model-override-args", json.dumps({"text_config": {"use_sliding_window": True}})],
        "does not support Qwen2VLForConditionalGeneration with a sliding window",
    ),
]


def _stock_launch(
    model, log: Path, config: dict, extra: list[str], backend: bool = True
) -> tuple[int, str]:
    """Start stock SGLang with sgl_mmkv's config in the environment (and its radix cache
    unless ``backend`` is False); return its exit status and log once it exits (a
    server that comes up instead is stopped and fails the test)."""
    env = {**stock_cpu_env(), CONFIG_ENV: json.dumps(config)}
    backend_flag = ["--radix-cache-backend", "sgl_mmkv"] if backend else []
    args = [*CPU_SERVER_ARGS, *backend_flag, *extra]
    server = ServerProcess("sglang.launch_server", model, args, log, env=env)
    try:
        server.start(timeout_s=600, attempts=1)
    except RuntimeError:
        return server.process.returncode, server.log_text()
    server.stop()
    raise AssertionError(f"stock launch with {extra} was not refused")


@pytest.fixture(scope="module")
def scheduler_refusals(tiny_vlm, tmp_path_factory) -> dict[str, tuple[int, str]]:
    logs = tmp_path_factory.mktemp("scheduler-refusals")
    with ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(_stock_launch, tiny_vlm, logs / f"{i}.log", config, extra)
            for i, (name, config, extra, _) in enumerate(SCHEDULER_CASES)
        }
        futures[NO_BACKEND] = pool.submit(
            _stock_launch, tiny_vlm, logs / "no-backend.log", {"mm_reuse": "conduit"}, [], False
        )
        return {name: future.result() for name, future in futures.items()}


NO_BACKEND = "refresh mode without sgl_mmkv's radix cache"


@pytest.mark.parametrize(
    ("name", "config", "extra", "named"), SCHEDULER_CASES, ids=[c[0] for c in SCHEDULER_CASES]
)
def test_stock_launch_with_our_cache_is_checked_in_the_scheduler(
    scheduler_refusals, name, config, extra, named
):
    returncode, log = scheduler_refusals[name]
    assert returncode != 0
    refusal = "sgl_mmkv.config.ConfigError: sgl_mmkv refuses to start: --mm-reuse conduit "
    reasons = [line for line in log.splitlines() if line.startswith(refusal)]
    assert len(reasons) == 1, log[-3000:]
    assert named in reasons[0]
    assert "radix cache active" not in log


def test_a_refresh_mode_without_our_cache_is_refused_at_start(scheduler_refusals):
    """The forward patches are registered, but no cache published their runtime: the
    scheduler stops at start-up with one line, not on the first request."""
    returncode, log = scheduler_refusals[NO_BACKEND]
    assert returncode != 0
    prefix = "sgl_mmkv.config.ConfigError: sgl_mmkv refuses to start: its refresh mode runs only"
    assert sum(line.startswith(prefix) for line in log.splitlines()) == 1, log[-3000:]


@pytest.fixture()
def own_environment():
    """SGLang's resolution sets environment variables; keep them out of other tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _effective(model, *flags: str):
    from sglang.srt.server_args import prepare_server_args

    from sgl_mmkv.support import effective_settings

    record = prepare_server_args(["--model-path", str(model), "--device", "cpu", *flags])
    args, hf_config = effective_settings(record)
    assert not getattr(record, "_resolution_finished", False)  # run_server resolves it
    return args, hf_config


@pytest.mark.parametrize(
    "flags, refused",
    [
        # SGLang turns every CUDA graph off for torch_native: nothing to refuse
        (["--attention-backend", "torch_native", "--cuda-graph-backend-prefill", "full"], None),
        (["--attention-backend", "intel_amx"], None),
        (["--attention-backend", "intel_amx", "--cuda-graph-backend-prefill", "full"], "prefill"),
        (
            ["--attention-backend", "intel_amx"]
            + ["--cuda-graph-config", '{"prefill": {"backend": "breakable"}}'],
            "prefill",
        ),
    ],
)
def test_graph_checks_read_sglang_resolved_config(own_environment, tiny_vlm, flags, refused):
    args, hf_config = _effective(tiny_vlm, *flags)
    config = MMKVConfig(mm_reuse="conduit")
    if refused is None:
        check_effective(config, args, hf_config)
        return
    with pytest.raises(ConfigError, match=f"{refused} CUDA graphs"):
        check_effective(config, args, hf_config)


def test_decode_graphs_are_refused_only_for_rows_that_shrink(own_environment, tiny_vlm):
    graphs = ["--attention-backend", "intel_amx"]
    args, hf_config = _effective(tiny_vlm, *graphs)
    assert graph_backend(args.cuda_graph_config, "decode") == "full"
    check_effective(MMKVConfig(mm_reuse="conduit"), args, hf_config)
    recompute = MMKVConfig(mm_reuse="conduit", mm_evict="snapkv", mm_compressed_reuse="recompute")
    check_effective(recompute, args, hf_config)
    for shrinking in (
        MMKVConfig(mm_reuse="conduit", mm_evict="snapkv"),
        MMKVConfig(mm_reuse="conduit", mm_evict="snapkv", mm_compress_at="decode"),
    ):
        with pytest.raises(ConfigError, match="add --disable-decode-cuda-graph"):
            check_effective(shrinking, args, hf_config)
    args, hf_config = _effective(tiny_vlm, *graphs, "--disable-decode-cuda-graph")
    check_effective(MMKVConfig(mm_reuse="conduit", mm_evict="snapkv"), args, hf_config)


def test_the_model_is_checked_after_sglang_overrides(own_environment, tiny_vlm):
    override = {"text_config": {"rope_parameters": LONGROPE}}
    args, hf_config = _effective(tiny_vlm, "--json-model-override-args", json.dumps(override))
    assert rope_type(hf_config) == "longrope"
    check_model("--mm-reuse conduit", str(tiny_vlm))  # the file alone passes
    with pytest.raises(ConfigError, match="longrope rotary scaling"):
        check_effective(MMKVConfig(mm_reuse="conduit"), args, hf_config)
    layers = json.dumps({"num_hidden_layers": 1, "text_config": {"num_hidden_layers": 1}})
    args, hf_config = _effective(tiny_vlm, "--json-model-override-args", layers)
    scored = MMKVConfig(mm_reuse="conduit", mm_refresh_scorer_args='{"layers": [1]}')
    with pytest.raises(ConfigError, match="the model has 1 layers"):
        check_effective(scored, args, hf_config)


def _model_with_rope(tmp_path, rope: dict | None, field: str = "rope_parameters"):
    """A config-only Qwen2-VL directory whose text model uses ``rope``."""
    text = {"rope_theta": 1e6} | ({field: rope} if rope is not None else {})
    config = {"architectures": ["Qwen2VLForConditionalGeneration"], "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


LINEAR_ROPES = [
    None,
    {"rope_type": "default", "mrope_section": [16, 24, 24]},
    {"type": "mrope", "mrope_section": [16, 24, 24]},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "mrope_section": [16, 24, 24]},
    {"rope_type": "llama3", "factor": 8.0},
]


LINEAR_IDS = ["none", "mrope", "mrope-legacy", "linear", "dynamic", "yarn-mrope", "llama3"]


@pytest.mark.parametrize("rope", LINEAR_ROPES, ids=LINEAR_IDS)
def test_rotaries_linear_in_position_are_accepted(tmp_path, rope):
    check_model("--mm-reuse conduit", _model_with_rope(tmp_path, rope))


@pytest.mark.parametrize("kind", ["longrope", "su", "proportional", "deepseek_yarn"])
@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_other_rotary_scalings_are_refused_in_one_line(tmp_path, kind, field):
    with pytest.raises(ConfigError) as refused:
        check_model("--mm-reuse conduit", _model_with_rope(tmp_path, {"rope_type": kind}, field))
    line = str(refused.value)
    assert "\n" not in line and f"{kind} rotary scaling" in line
    assert "supported scalings: linear, dynamic, yarn, llama3" in line


def test_scorer_layers_the_model_lacks_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 4}}))
    check_scored_layers((0, 3), str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        check_scored_layers((2, 4), str(tmp_path))
    assert str(refused.value) == (
        "--mm-refresh-scorer-args layers [2, 4]: the model has 4 layers (ids 0-3)"
    )


def _model_of_class(tmp_path, name: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [name]}))
    return str(tmp_path)


@pytest.mark.parametrize(
    "name, refused",
    [
        ("Qwen2VLForConditionalGeneration", False),
        ("Qwen2_5_VLForConditionalGeneration", False),
        ("Qwen3VLForConditionalGeneration", False),
        ("LlavaForConditionalGeneration", True),
    ],
)
def test_decode_time_compression_is_refused_before_start_without_mrope(tmp_path, name, refused):
    path = _model_of_class(tmp_path, name)
    check_model("--mm-reuse conduit", path)  # every supported class reuses
    if not refused:
        check_model("--mm-reuse conduit", path, compresses_at_decode=True)
        return
    with pytest.raises(ConfigError) as refusal:
        check_model("--mm-reuse conduit", path, compresses_at_decode=True)
    assert str(refusal.value).startswith(f"--mm-compress-at decode does not support {name}")
    assert "\n" not in str(refusal.value)


def test_the_model_is_checked_as_sglang_loads_it(own_environment, tiny_vlm, tmp_path):
    """transformers resets a Qwen2-VL text config's rotary to M-RoPE when it loads, so
    SGLang runs M-RoPE although the file says LongRoPE: the start is accepted."""
    model = tmp_path / "tiny-qwen2-vl-longrope-file"
    shutil.copytree(tiny_vlm, model)
    config = json.loads((model / "config.json").read_text())
    for scope in (config, config["text_config"]):
        scope["rope_parameters"] = {**scope.get("rope_parameters", {}), **LONGROPE}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="longrope rotary scaling"):
        check_model("--mm-reuse conduit", str(model))  # the file alone
    args, hf_config = _effective(model)
    assert rope_type(hf_config) is None
    check_effective(MMKVConfig(mm_reuse="conduit"), args, hf_config)


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", "auto"])
def test_plain_kv_dtypes_sglang_accepts_are_accepted(own_environment, tiny_vlm, dtype):
    args, hf_config = _effective(tiny_vlm, "--kv-cache-dtype", dtype)
    check_effective(MMKVConfig(mm_reuse="conduit"), args, hf_config)


def test_last_hidden_states_only_are_accepted(own_environment, tiny_vlm):
    """Mode ``last`` captures the last row only, which every pass computes."""
    args, hf_config = _effective(tiny_vlm, "--return-hidden-states-mode", "last")
    assert args.enable_return_hidden_states  # SGLang sets the switch for it
    check_effective(MMKVConfig(mm_reuse="conduit"), args, hf_config)
    args, hf_config = _effective(tiny_vlm, "--enable-return-hidden-states")
    assert args.return_hidden_states_mode == "full"
    with pytest.raises(ConfigError, match="--enable-return-hidden-states"):
        check_effective(MMKVConfig(mm_reuse="conduit"), args, hf_config)
    check_effective(MMKVConfig(mm_reuse="exact"), args, hf_config)


FP8_DECLARATIONS = [
    {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
    {"kv_cache_quant_algo": "FP8"},
]


@pytest.mark.parametrize("declared", FP8_DECLARATIONS, ids=["compressed-tensors", "modelopt"])
def test_a_checkpoint_that_declares_fp8_kv_is_refused_under_auto_on_torch_native(
    own_environment, tiny_vlm, declared
):
    """A checkpoint's per-tensor fp8 KV (taken by ``auto``) is served with a backend
    that applies its scales, and refused on torch_native, which ignores them."""
    args, hf_config = _effective(tiny_vlm, *TORCH_NATIVE)
    quantized = {**hf_config, "quantization_config": {"quant_method": "x", **declared}}
    with pytest.raises(ConfigError) as refusal:
        check_effective(MMKVConfig(mm_reuse="conduit"), args, quantized)
    assert "the checkpoint's fp8 KV" in str(refusal.value)
    assert "on the torch_native attention backend" in str(refusal.value)
    assert "pass --kv-cache-dtype bf16" in str(refusal.value)
    args, _ = _effective(tiny_vlm, "--kv-cache-dtype", "bf16", *TORCH_NATIVE)
    check_effective(MMKVConfig(mm_reuse="conduit"), args, quantized)  # bf16 asked: plain
    scaled = _Overridden(args, attention_backend="triton")  # a CUDA resolution
    check_effective(MMKVConfig(mm_reuse="conduit"), scaled, quantized)  # scales applied


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_per_tensor_fp8_kv_is_accepted_with_a_backend_that_applies_its_scales(
    own_environment, tiny_vlm, dtype
):
    """SGLang falls back to torch_native on a CPU without AMX, so the scale-aware
    backends are set on its resolved args as a CUDA resolution would."""
    args, hf_config = _effective(tiny_vlm, "--kv-cache-dtype", dtype, *TORCH_NATIVE)
    for backend in ("triton", "flashinfer", "fa3", "intel_amx"):
        scaled = _Overridden(args, attention_backend=backend)
        check_effective(MMKVConfig(mm_reuse="conduit"), scaled, hf_config)
    with pytest.raises(ConfigError, match=f"--kv-cache-dtype {dtype} with the torch_native"):
        check_effective(MMKVConfig(mm_reuse="conduit"), args, hf_config)
    check_effective(MMKVConfig(mm_reuse="exact"), args, hf_config)  # no refresh: stock


class _Pool:
    def __init__(self, dtype, stored, block_scales: bool = False):
        self.dtype = dtype
        self._k = torch.zeros(4, 2, 8, dtype=stored)
        # MXFP8's / FP4's pools keep per-token / per-block scales beside the KV
        self.k_scale_buffer = [torch.ones(4, 2, 1)] if block_scales else None

    def get_key_buffer(self, layer):
        return self._k


@pytest.mark.parametrize(
    ("dtype", "stored", "block_scales", "refused"),
    [
        (torch.bfloat16, torch.bfloat16, False, None),
        (torch.float16, torch.float16, False, None),
        # SGLang stores fp8 KV as bytes and reads it through an fp8 view: per-tensor
        # scales, which the refresh path applies
        (torch.float8_e4m3fn, torch.float8_e4m3fn, False, None),
        (torch.float8_e5m2, torch.float8_e5m2, False, None),
        (torch.float8_e4m3fn, torch.float8_e4m3fn, True, "torch.float8_e4m3fn"),
        (torch.float8_e4m3fn, torch.uint8, False, "torch.uint8"),  # bytes read as numbers
        (torch.int8, torch.int8, False, "torch.int8"),
    ],
)
def test_the_pool_sglang_built_is_checked_not_the_flag(dtype, stored, block_scales, refused):
    from sgl_mmkv.support import check_pool_dtype

    pool = _Pool(dtype, stored, block_scales)
    if refused is None:
        check_pool_dtype("--mm-reuse conduit", pool)
        return
    with pytest.raises(ConfigError, match="KV pool") as refusal:
        check_pool_dtype("--mm-reuse conduit", pool)
    message = str(refusal.value)
    assert f"a {refused} KV pool" in message and "\n" not in message
    assert "per-token / per-block scales" in message


class _Overridden:
    """SGLang's resolved args with some fields as another resolution would set them
    (trtllm_mha forces page size 64 on Blackwell, which this CPU cannot resolve)."""

    def __init__(self, args, **fields):
        self._args, self._fields = args, fields

    def __getattr__(self, name):
        return self._fields[name] if name in self._fields else getattr(self._args, name)


def test_a_page_size_an_attention_backend_forced_names_the_backend(own_environment, tiny_vlm):
    """Refresh modes serve any page size; only rows that shrink after prefill (reuse
    holes, decode-time compression) need page size 1, and the refusal names the
    backend that forced the page size."""
    args, hf_config = _effective(tiny_vlm)
    forced = _Overridden(args, page_size=64, attention_backend="trtllm_mha")
    check_effective(MMKVConfig(mm_reuse="conduit"), forced, hf_config)
    recompute = MMKVConfig(mm_reuse="conduit", mm_evict="snapkv", mm_compressed_reuse="recompute")
    check_effective(recompute, forced, hf_config)
    check_effective(MMKVConfig(mm_reuse="exact"), forced, hf_config)
    shrinking = [
        MMKVConfig(mm_reuse="conduit", mm_evict="snapkv"),  # reuse holes, the default
        MMKVConfig(
            mm_reuse="conduit",
            mm_evict="snapkv",
            mm_compress_at="decode",
            mm_compressed_reuse="recompute",
        ),
    ]
    for config in shrinking:
        with pytest.raises(ConfigError) as refusal:
            check_effective(config, forced, hf_config)
        line = str(refusal.value)
        assert "page size 64 (--page-size, or forced by the attention backend" in line
        assert "trtllm_mha" in line and "rows that shrink after prefill" in line
        assert "--mm-compressed-reuse recompute" in line and "\n" not in line
