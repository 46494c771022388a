"""sgl_mmkv's typed configuration: command-line flags -> one dataclass -> every process.

SGLang spawns its scheduler and detokenizer, so module state of the launching
process does not reach them. The config travels as JSON in the environment
variable :data:`CONFIG_ENV`, which spawned children inherit, and the plugin reads
it back in each process.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field

from sgl_mmkv.scoring import (
    AUTO_BUDGET,
    EVICTION_SCORERS,
    REFRESH_SCORERS,
    RefreshBudget,
    make_refresh_scorer,
)
from sgl_mmkv.scoring.knobs import json_object, parse_knobs, scorer_knobs

CONFIG_ENV = "MMKV_SGLANG_CONFIG"

# Every --mm-reuse choice: the two cache modes, then one per refresh scorer.
REUSE_MODES: dict[str, str] = {
    "off": "stock SGLang: no sgl_mmkv code in the scheduler but a CPU-only fix for --tp-size > 1",
    "exact": "sgl_mmkv's radix cache, exact-prefix reuse only (same hits as stock)",
    **{name: cls.summary or name for name, cls in REFRESH_SCORERS.items()},
}
CACHE_ONLY_MODES: tuple[str, ...] = ("off", "exact")

DEFAULT_REFRESH_BUDGET = 0.1
# The --mm-reuse scorers that take --mm-refresh-budget auto.
ADAPTIVE_SCORERS: tuple[str, ...] = tuple(n for n, c in REFRESH_SCORERS.items() if c.adapts_budget)
# How a new image's KV enters the segment store (refresh modes).
SEGMENT_FILL_POLICIES: dict[str, str] = {
    "first": "copied from the first request that shows the image (its context included)",
    "canonical": "recomputed for the image alone, after its <|vision_start|> token",
}
DEFAULT_SEGMENT_FILL = "first"
# --mm-evict: how cached image segments give way under memory pressure.
EVICTION_POLICIES: dict[str, str] = {
    "lru": "whole segments, least recently used first (stock-like)",
    **{
        name: f"compress segments to their top tokens by {cls.summary or name}, then LRU"
        for name, cls in EVICTION_SCORERS.items()
    },
}
DEFAULT_EVICTION = "lru"
DEFAULT_KV_BUDGET = 0.5
# --mm-compress-at: when a scored segment is compressed.
COMPRESS_TRIGGERS: dict[str, str] = {
    "pressure": "when an allocation finds the pool short (before whole segments go)",
    "fill": "as soon as it is stored (more images in the same memory)",
    "decode": "after each request's prefill, its own row keeps its top visual tokens for "
    "decoding (M-RoPE models; the request is not inserted into the radix tree)",
}
DEFAULT_COMPRESS_AT = "pressure"
# --mm-compressed-reuse: what a reused compressed segment does with its dropped tokens.
COMPRESSED_REUSE: dict[str, str] = {
    "holes": "leave them out: neither computed nor attended (the row is kept out of "
    "the radix tree; later positions keep the sequence's)",
    "recompute": "compute them fresh like text (any model)",
}
DEFAULT_COMPRESSED_REUSE = "holes"
# --mm-reuse-gate: whether a matched image is reused when reuse costs more.
REUSE_GATES: dict[str, str] = {
    "cost": "serve a request as stock does when its reuse would compute more FLOPs "
    "than its full prefill",
    "always": "reuse every matched image (to measure a method at any reuse ratio)",
}
DEFAULT_REUSE_GATE = "cost"
# --mm-segment-storage: "none", or a backend name of SGLang's StorageBackendFactory
# (checked against the factory once SGLang is imported: sgl_mmkv.support).
NO_SEGMENT_STORAGE = "none"
MOONCAKE_STORAGE = "mooncake"  # Mooncake's own client (sgl_mmkv/segments/mooncake_store.py)
SEGMENT_STORAGE_METAVAR = "{none,file,mooncake,hf3fs,nixl,...}"
DEFAULT_STORAGE_DEADLINE_MS = 200.0
DEFAULT_EMBEDDINGS_MAX_GIB = 1.0
MAX_STORAGE_DEADLINE_MS = 60_000.0
RADIX_CACHE_BACKEND_NAME = "sgl_mmkv"


class ConfigError(ValueError):
    """A flag value sgl_mmkv cannot run with; the message says which and why."""


def _flag(
    default,
    help: str,
    choices: dict[str, str] | None = None,
    metavar: str | None = None,
    parse=None,
):
    """A config field that is also a launcher flag (``mm_kv_budget`` -> ``--mm-kv-budget``);
    the launcher builds its parser from these fields (``parse``: the flag's argparse
    type; default the type of ``default``)."""
    metadata = {"help": help, "choices": choices, "metavar": metavar, "parse": parse}
    return field(default=default, metadata=metadata)


def parse_refresh_budget(text: str) -> RefreshBudget:
    """``--mm-refresh-budget``'s value: ``auto``, else a number (range checked by the
    config)."""
    if text == AUTO_BUDGET:
        return AUTO_BUDGET
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number in [0, 1] or {AUTO_BUDGET}, got {text!r}"
        ) from None


def flag_name(field_name: str) -> str:
    """The command-line flag of a config field."""
    return "--" + field_name.replace("_", "-")


def _require_choice(flag: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} {value!r} is unknown; choose one of {', '.join(choices)}")


def _is_real(value) -> bool:
    """A real number given as a flag value (``True`` / ``False`` are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class MMKVConfig:
    """What sgl_mmkv does in this server.

    Attributes:
        mm_reuse: one of :data:`REUSE_MODES`.
        mm_refresh_budget: fraction of reused image tokens recomputed, in [0, 1]
            (0 recomputes only the text, as ``reuse``), or ``auto``: each request's,
            sized by a scorer that measures staleness (``staleprobe``).
        mm_refresh_scorer_args: JSON object of the ``--mm-reuse`` scorer's knobs
            (empty: its defaults), e.g. ``{"use_value_norm": false}`` for an ablation.
        mm_segment_fill: one of :data:`SEGMENT_FILL_POLICIES`.
        mm_evict: one of :data:`EVICTION_POLICIES`.
        mm_kv_budget: fraction of a segment's visual tokens kept when compressing,
            in (0, 1].
        mm_compress_at: one of :data:`COMPRESS_TRIGGERS`.
        mm_compressed_reuse: one of :data:`COMPRESSED_REUSE`.
        mm_reuse_gate: one of :data:`REUSE_GATES`.
        mm_report_reuse: whether reuse facts reach callers (per-request meta info,
            ``/get_server_info``, every counter in ``/metrics``); off by default, since
            they reveal other clients' images.
        mm_embeddings_max_gib: host memory (GiB) for the vision-encoder output the
            segments keep; 0: none (a reusing request runs the vision tower).
        mm_segment_storage: ``none``, or the SGLang storage backend (``file``,
            ``mooncake``, ...) segments are written through to and loaded from.
        mm_segment_storage_dir: the ``file`` backend's directory.
        mm_segment_storage_config: JSON object passed to the backend as SGLang's
            ``extra_config`` (empty: none); with ``mooncake``, the keys of
            ``sgl_mmkv.segments.mooncake_store.MooncakeSettings``.
        mm_segment_storage_deadline_ms: the longest a forward waits for one storage
            read; a later read is a counted miss.
        mm_segment_storage_max_gib: every entry of a ``file`` directory together
            (old entries give way); 0: half its file system's free space at start.
        mm_segment_storage_namespace_max_gib: the entries of one namespace (salt,
            extra key, adapter); 0: half of the total cap.
    """

    mm_reuse: str = _flag("off", "image KV reuse mode", REUSE_MODES)
    mm_refresh_budget: RefreshBudget = _flag(
        DEFAULT_REFRESH_BUDGET,
        f"fraction of reused image tokens recomputed, in [0, 1], or {AUTO_BUDGET}: each "
        "request's own, from how stale its scoring pass finds its images "
        f"(--mm-reuse {', '.join(ADAPTIVE_SCORERS)})",
        metavar="{R," + AUTO_BUDGET + "}",
        parse=parse_refresh_budget,
    )
    mm_refresh_scorer_args: str = _flag(
        "",
        "JSON object of the --mm-reuse scorer's knobs, e.g. '{\"use_value_norm\": false}' "
        f"(conduit's: {', '.join(scorer_knobs(REFRESH_SCORERS['conduit']))})",
        metavar="JSON",
    )
    mm_segment_fill: str = _flag(
        DEFAULT_SEGMENT_FILL, "how a new image's KV enters the segment store", SEGMENT_FILL_POLICIES
    )
    mm_evict: str = _flag(
        DEFAULT_EVICTION,
        "how cached image segments give way under memory pressure",
        EVICTION_POLICIES,
    )
    mm_kv_budget: float = _flag(
        DEFAULT_KV_BUDGET,
        "fraction of a segment's visual tokens kept when it is compressed, in (0, 1]",
    )
    mm_compress_at: str = _flag(
        DEFAULT_COMPRESS_AT, "when a scored segment is compressed", COMPRESS_TRIGGERS
    )
    mm_compressed_reuse: str = _flag(
        DEFAULT_COMPRESSED_REUSE,
        "what a reused compressed segment does with its dropped tokens",
        COMPRESSED_REUSE,
    )
    mm_reuse_gate: str = _flag(
        DEFAULT_REUSE_GATE,
        "whether a matched image is reused when reuse costs more than a full prefill",
        REUSE_GATES,
    )
    mm_report_reuse: bool = _flag(
        False,
        "return per-request reuse facts (meta_info['sgl_mmkv'], a log line) and "
        "sgl_mmkv's counters in /get_server_info; they tell a caller whether another "
        "client sent an image; with --enable-metrics, every counter in /metrics too "
        "(off: only coarse ones)",
    )
    mm_embeddings_max_gib: float = _flag(
        DEFAULT_EMBEDDINGS_MAX_GIB,
        "host memory for stored images' vision-encoder output, kept with their segments "
        "(and written to --mm-segment-storage) so that a reusing request skips the "
        "vision tower; least recently used let go first (0: keep none)",
        metavar="GIB",
    )
    mm_segment_storage: str = _flag(
        NO_SEGMENT_STORAGE,
        "L3 tier below the segment store: none, or an SGLang HiCache storage backend "
        "(its StorageBackendFactory names) that segments are written to and loaded from, "
        "shared by every instance pointed at it",
        metavar=SEGMENT_STORAGE_METAVAR,
    )
    mm_segment_storage_dir: str = _flag(
        "", "directory of --mm-segment-storage file", metavar="PATH"
    )
    mm_segment_storage_config: str = _flag(
        "",
        "JSON object passed to the --mm-segment-storage backend as SGLang's extra_config; "
        "mooncake: master_server_address, metadata_server, local_hostname, protocol, "
        "global_segment_size, local_buffer_size, ... (docs/deployment.md)",
        metavar="JSON",
    )
    mm_segment_storage_deadline_ms: float = _flag(
        DEFAULT_STORAGE_DEADLINE_MS,
        "the longest a forward waits for one --mm-segment-storage read; a later read is "
        "a counted miss (the image is computed)",
        metavar="MS",
    )
    mm_segment_storage_max_gib: float = _flag(
        0.0,
        "size cap of a --mm-segment-storage file directory, old entries give way "
        "(0: half the file system's free space at start)",
        metavar="GIB",
    )
    mm_segment_storage_namespace_max_gib: float = _flag(
        0.0,
        "size cap of one namespace's entries (cache_salt, extra key, adapter) in a "
        "--mm-segment-storage file directory, its old entries give way first "
        "(0: half of the total cap)",
        metavar="GIB",
    )

    def __post_init__(self) -> None:
        _require_choice("--mm-reuse", self.mm_reuse, REUSE_MODES)
        budget = self.mm_refresh_budget
        if budget == AUTO_BUDGET:
            if self.mm_reuse not in ADAPTIVE_SCORERS:
                raise ConfigError(
                    f"--mm-refresh-budget {AUTO_BUDGET} needs a --mm-reuse that measures "
                    f"staleness ({', '.join(ADAPTIVE_SCORERS)}), not {self.mm_reuse}"
                )
        elif not (_is_real(budget) and 0.0 <= budget <= 1.0):
            raise ConfigError(
                f"--mm-refresh-budget must be in [0, 1] or {AUTO_BUDGET}, got {budget!r}"
            )
        self._check_scorer_args()
        _require_choice("--mm-segment-fill", self.mm_segment_fill, SEGMENT_FILL_POLICIES)
        if self.mm_segment_fill != DEFAULT_SEGMENT_FILL and not self.uses_refresh:
            raise ConfigError(
                f"--mm-segment-fill {self.mm_segment_fill} needs a refresh mode of --mm-reuse "
                f"(the segment store), not {self.mm_reuse}"
            )
        _require_choice("--mm-reuse-gate", self.mm_reuse_gate, REUSE_GATES)
        if self.mm_reuse_gate != DEFAULT_REUSE_GATE and not self.uses_refresh:
            raise ConfigError(
                f"--mm-reuse-gate {self.mm_reuse_gate} needs a refresh mode of --mm-reuse, "
                f"not {self.mm_reuse}"
            )
        if self.mm_report_reuse is not False and self.mm_report_reuse is not True:
            raise ConfigError(f"--mm-report-reuse is a switch, got {self.mm_report_reuse!r}")
        if self.mm_report_reuse and not self.uses_mmkv_cache:
            raise ConfigError("--mm-report-reuse needs --mm-reuse other than off")
        self._check_eviction()
        self._check_embeddings()
        self._check_storage()

    def _check_embeddings(self) -> None:
        cap = self.mm_embeddings_max_gib
        if not (_is_real(cap) and 0.0 <= cap < float("inf")):
            raise ConfigError(f"--mm-embeddings-max-gib must be a size in GiB >= 0, got {cap!r}")
        if cap != DEFAULT_EMBEDDINGS_MAX_GIB and not self.uses_refresh:
            raise ConfigError(
                f"--mm-embeddings-max-gib needs a refresh mode of --mm-reuse (the segment "
                f"store), not {self.mm_reuse}"
            )

    def _check_scorer_args(self) -> None:
        text = self.mm_refresh_scorer_args
        if not isinstance(text, str):
            raise ConfigError(f"--mm-refresh-scorer-args must be a JSON object, got {text!r}")
        if text and not self.uses_refresh:
            raise ConfigError(
                f"--mm-refresh-scorer-args needs a refresh mode of --mm-reuse, not {self.mm_reuse}"
            )
        if not self.uses_refresh:
            return
        try:
            make_refresh_scorer(self.mm_reuse, **self.refresh_scorer_knobs())
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"--mm-refresh-scorer-args: {exc}") from exc

    def refresh_scorer_knobs(self) -> dict:
        """``--mm-refresh-scorer-args`` as keyword arguments of the scorer (empty: none)."""
        if not self.uses_refresh:
            return {}
        return parse_knobs(REFRESH_SCORERS[self.mm_reuse], self.mm_refresh_scorer_args)

    @property
    def scored_layers(self) -> tuple[int, ...] | None:
        """The model layers the refresh scorer averages over (None: every layer)."""
        layers = self.refresh_scorer_knobs().get("layers")
        return None if layers is None else tuple(layers)

    def _check_storage(self) -> None:
        name = self.mm_segment_storage
        if not (isinstance(name, str) and name.replace("_", "").isalnum()):
            raise ConfigError(f"--mm-segment-storage must be a backend name, got {name!r}")
        if name != NO_SEGMENT_STORAGE and not self.uses_refresh:
            raise ConfigError(
                f"--mm-segment-storage {name} stores segments of the segment store and needs "
                f"a refresh mode of --mm-reuse, not {self.mm_reuse}"
            )
        if name == NO_SEGMENT_STORAGE and (
            self.mm_segment_storage_dir or self.mm_segment_storage_config
        ):
            raise ConfigError(
                "--mm-segment-storage-dir and --mm-segment-storage-config need "
                "--mm-segment-storage other than none"
            )
        if name == "file" and not self.mm_segment_storage_dir:
            raise ConfigError("--mm-segment-storage file needs --mm-segment-storage-dir PATH")
        if name == MOONCAKE_STORAGE:
            self._check_mooncake_flags()
        self.storage_extra_config()
        self._check_storage_limits()

    def _check_mooncake_flags(self) -> None:
        if self.mm_segment_storage_dir:
            raise ConfigError(
                "--mm-segment-storage-dir is the file backend's; mooncake is set up by "
                "--mm-segment-storage-config (master_server_address, metadata_server, ...)"
            )
        if self.mm_segment_storage_max_gib or self.mm_segment_storage_namespace_max_gib:
            raise ConfigError(
                "--mm-segment-storage-max-gib and --mm-segment-storage-namespace-max-gib cap "
                "a file directory; Mooncake's master evicts by its own policy "
                "(mooncake_master -eviction_high_watermark_ratio)"
            )

    def _check_storage_limits(self) -> None:
        deadline = self.mm_segment_storage_deadline_ms
        if not (_is_real(deadline) and 0.0 < deadline <= MAX_STORAGE_DEADLINE_MS):
            raise ConfigError(
                f"--mm-segment-storage-deadline-ms must be in (0, {MAX_STORAGE_DEADLINE_MS:g}], "
                f"got {deadline!r}"
            )
        caps = {
            "--mm-segment-storage-max-gib": self.mm_segment_storage_max_gib,
            "--mm-segment-storage-namespace-max-gib": self.mm_segment_storage_namespace_max_gib,
        }
        for flag, value in caps.items():
            if not (_is_real(value) and 0.0 <= value < float("inf")):
                raise ConfigError(f"{flag} must be a size in GiB >= 0, got {value!r}")
        changed = deadline != DEFAULT_STORAGE_DEADLINE_MS or any(caps.values())
        if changed and not self.uses_segment_storage:
            raise ConfigError(
                "--mm-segment-storage-deadline-ms, --mm-segment-storage-max-gib and "
                "--mm-segment-storage-namespace-max-gib need --mm-segment-storage other than none"
            )
        total, space = caps.values()
        if total and space > total:
            raise ConfigError(
                f"--mm-segment-storage-namespace-max-gib {space:g} is above "
                f"--mm-segment-storage-max-gib {total:g}"
            )

    def storage_extra_config(self) -> dict:
        """``--mm-segment-storage-config`` as a dict (empty when not given)."""
        text = self.mm_segment_storage_config
        if not text:
            return {}
        try:
            return json_object(text)
        except ValueError as exc:
            raise ConfigError(f"--mm-segment-storage-config {exc}") from exc

    @property
    def uses_segment_storage(self) -> bool:
        """Whether segments are written to and loaded from an L3 storage backend."""
        return self.mm_segment_storage != NO_SEGMENT_STORAGE

    def _check_eviction(self) -> None:
        _require_choice("--mm-evict", self.mm_evict, EVICTION_POLICIES)
        budget = self.mm_kv_budget
        if not (_is_real(budget) and 0.0 < budget <= 1.0):
            raise ConfigError(f"--mm-kv-budget must be in (0, 1], got {budget!r}")
        _require_choice("--mm-compress-at", self.mm_compress_at, COMPRESS_TRIGGERS)
        _require_choice("--mm-compressed-reuse", self.mm_compressed_reuse, COMPRESSED_REUSE)
        if self.uses_scored_eviction and not self.uses_refresh:
            raise ConfigError(
                f"--mm-evict {self.mm_evict} compresses segments of the segment store and "
                f"needs a refresh mode of --mm-reuse, not {self.mm_reuse}"
            )
        changed = (
            self.mm_kv_budget != DEFAULT_KV_BUDGET
            or self.mm_compress_at != DEFAULT_COMPRESS_AT
            or self.mm_compressed_reuse != DEFAULT_COMPRESSED_REUSE
        )
        if changed and not self.uses_scored_eviction:
            raise ConfigError(
                "--mm-kv-budget, --mm-compress-at and --mm-compressed-reuse need a scored "
                "--mm-evict "
                f"({', '.join(p for p in EVICTION_POLICIES if p != DEFAULT_EVICTION)})"
            )

    @property
    def uses_scored_eviction(self) -> bool:
        """Whether segments are ranked at fill and compressed (an ``--mm-evict`` scorer)."""
        return self.mm_evict != DEFAULT_EVICTION

    @property
    def compresses_at_decode(self) -> bool:
        """Whether running requests' rows shrink after prefill (``--mm-compress-at decode``)."""
        return self.uses_scored_eviction and self.mm_compress_at == "decode"

    @property
    def reuses_with_holes(self) -> bool:
        """Whether reused compressed segments leave holes (rows shrink after prefill)."""
        return self.uses_scored_eviction and self.mm_compressed_reuse == "holes"

    @property
    def uses_mmkv_cache(self) -> bool:
        """Whether the scheduler runs sgl_mmkv's radix cache backend."""
        return self.mm_reuse != "off"

    @property
    def uses_refresh(self) -> bool:
        """Whether image segments are reused under any prefix (a scorer mode)."""
        return self.mm_reuse not in CACHE_ONLY_MODES

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MMKVConfig:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{CONFIG_ENV} is not JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise ConfigError(f"{CONFIG_ENV} must be a JSON object, got {text!r}")
        return cls(**fields)


def export_config(config: MMKVConfig) -> None:
    """Publish ``config`` to this process and every process it spawns."""
    os.environ[CONFIG_ENV] = config.to_json()


def active_config() -> MMKVConfig | None:
    """The config this process was started with, or None outside sgl_mmkv.launch_server."""
    text = os.environ.get(CONFIG_ENV)
    return MMKVConfig.from_json(text) if text else None
