"""What the refresh path does not support is refused before the server starts: the
launcher exits with status 2 and one line naming the flag or the model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_mmkv.config import ConfigError
from sgl_mmkv.support import check_model, check_scored_layers
from sgl_mmkv.testing.server import stock_cpu_env

# (case, extra flags, what the one-line reason must name)
FLAG_CASES = [
    ("tensor parallel", ["--tp-size", "2"], "--tp-size 2"),
    ("data parallel", ["--dp-size", "2"], "--dp-size 2"),
    ("dp attention", ["--enable-dp-attention", "--dp-size", "2"], "--enable-dp-attention"),
    ("pipeline parallel", ["--pp-size", "2"], "--pp-size 2"),
    ("speculative", ["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE"),
    ("lora", ["--enable-lora"], "--enable-lora"),
    ("lora paths", ["--lora-paths", "a=/nonexistent"], "--lora-paths"),
    ("fp8 kv", ["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),
    ("prefill graphs", ["--cuda-graph-backend-prefill", "full"], "--cuda-graph-backend-prefill"),
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
]


def _launch(model, extra: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "sgl_mmkv.launch_server", "--model-path", str(model)]
    return subprocess.run(
        [*command, "--mm-reuse", "conduit", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=stock_cpu_env(),
    )


@pytest.fixture(scope="module")
def longrope_vlm(tiny_vlm, tmp_path_factory):
    """The tiny VLM's files with LongRoPE rotary scaling in its config."""
    out = tmp_path_factory.mktemp("longrope") / "tiny-qwen2-vl-longrope"
    shutil.copytree(tiny_vlm, out)
    config = json.loads((out / "config.json").read_text())
    for scope in (config, config.get("text_config") or {}):
        params = {**scope.get("rope_parameters", {}), "rope_type": "longrope"}
        params.update(short_factor=[1.0], long_factor=[4.0])
        scope["rope_parameters"] = params
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def launches(tiny_vlm, tiny_llm, longrope_vlm) -> dict[str, subprocess.CompletedProcess]:
    """Every refused start-up, two at a time (each imports SGLang, then exits)."""
    runs = {name: (tiny_vlm, extra) for name, extra, _ in FLAG_CASES}
    runs["text-only model"] = (tiny_llm, [])
    runs["longrope model"] = (longrope_vlm, [])
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(_launch, *run) for name, run in runs.items()}
        return {name: future.result() for name, future in futures.items()}


def _refused(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, done.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(("name", "extra", "named"), FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_an_unsupported_flag_is_refused_with_its_name(launches, name, extra, named):
    line = _refused(launches[name])
    assert named in line and "--mm-reuse conduit" in line


def test_a_text_only_model_is_refused(launches):
    line = _refused(launches["text-only model"])
    assert "does not support Qwen2ForCausalLM" in line and "--mm-reuse exact or off" in line


def test_a_rotary_not_linear_in_position_is_refused(launches):
    line = _refused(launches["longrope model"])
    assert "longrope rotary scaling" in line and "not linear in position" in line


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
