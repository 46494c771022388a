"""The model's identity in the L3 storage fingerprint: what must match for stored KV
to be valid in another server.

Two models served from one path must not exchange KV: the identity names the path
and revision, and digests the Hugging Face config, the weights (each safetensors
file's size and header, and the first bytes of every tensor in it, so two
fine-tunes of one architecture differ), the model dtype and the quantization. The
KV dtype, layout, pool and fill policy are the other fields of
:class:`~sgl_mmkv.segments.entry_format.KVFingerprint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_SAFETENSORS_HEADER = 100 * 2**20  # the format's own limit
TENSOR_PREFIX_BYTES = 64  # read from the start of every tensor
WINDOWS = 64  # evenly spaced reads of a weights file that is not safetensors
WINDOW_BYTES = 4096
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.gguf")


def model_identity(model_config) -> str:
    """``path@revision#config=..;weights=..;dtype=..;quant=..`` of SGLang's ``ModelConfig``
    (digests are 16 hex digits)."""
    try:
        text = model_config.hf_config.to_json_string()
    except Exception:  # a config transformers cannot serialise: the rest still counts
        text = ""
    config = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = str(model_config.model_path)
    weights = weights_digest(path)
    dtype = getattr(model_config, "dtype", None)
    quant = getattr(model_config, "quantization", None)
    revision = getattr(model_config, "revision", None)
    return f"{path}@{revision}#config={config};weights={weights};dtype={dtype};quant={quant}"


def updated_identity(model_config, from_disk: bool, weight_version: str | None) -> str:
    """The identity after a weight update. From disk: :func:`model_identity` of
    ``model_config`` as the update left it (its path set to the new checkpoint, whose
    files' digest names the weights). From tensors, IPC or a collective there are no
    files: the weight version SGLang records names them, and without one they get a
    random identity, so their entries are shared with no one."""
    base = model_identity(model_config) if model_config is not None else "unknown"
    if from_disk and model_config is not None:
        return base
    if weight_version not in (None, "", "default"):
        return f"{base};version={weight_version}"
    return f"{base};update={os.urandom(8).hex()}"


def weights_digest(model_path: str) -> str:
    """16 hex digits over the weight files of directory ``model_path``: names, sizes,
    safetensors headers (or ``model.safetensors.index.json``) and sampled bytes;
    ``"none"`` when it is not a local directory with weights (a hub id)."""
    root = Path(model_path)
    if not root.is_dir():
        return "none"
    files = sorted(root.glob("*.safetensors"))
    others = [] if files else sorted(p for g in OTHER_WEIGHTS for p in root.glob(g))
    if not files and not others:
        return "none"
    digest = hashlib.sha256()
    index = root / "model.safetensors.index.json"
    if index.is_file():
        digest.update(index.read_bytes())
    try:
        for path in files:
            _safetensors(path, digest)
        for path in others:
            _windows(path, digest)
    except (OSError, ValueError) as error:  # unreadable: named as such, never shared
        logger.warning(
            "sgl_mmkv: reading weights of %s for the fingerprint failed (%r)", root, error
        )
        return "unreadable-" + os.urandom(8).hex()
    return digest.hexdigest()[:16]


def _safetensors(path: Path, digest) -> None:
    """Name, size, header and the first bytes of each tensor of one safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < length <= min(MAX_SAFETENSORS_HEADER, size - 8):
            raise ValueError(f"{path.name}: not a safetensors file")
        header = f.read(length)
        digest.update(f"{path.name}:{size}:".encode() + raw + header)
        tensors = json.loads(header)
        starts = sorted(
            int(t["data_offsets"][0])
            for name, t in tensors.items()
            if name != "__metadata__" and isinstance(t, dict)
        )
        for start in starts:
            f.seek(8 + length + start)
            digest.update(f.read(TENSOR_PREFIX_BYTES))


def _windows(path: Path, digest) -> None:
    """Name, size and :data:`WINDOWS` evenly spaced reads of a weights file."""
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}:".encode())
    with open(path, "rb") as f:
        for i in range(WINDOWS):
            f.seek(max(0, size - WINDOW_BYTES) * i // (WINDOWS - 1))
            digest.update(f.read(WINDOW_BYTES))


def embedding_layout(model_config) -> tuple[int, str]:
    """``(width, dtype)`` of the vision encoder's output per image token, as a segment
    stores it (:class:`~sgl_mmkv.segments.entry_format.KVFingerprint`): the language
    model's hidden size, times 1 + the DeepStack layers (Qwen3-VL's encoder returns
    their features side by side), in the model dtype; ``(0, "")`` when the config does
    not say (entries then carry no embeddings)."""
    hidden = getattr(getattr(model_config, "hf_text_config", None), "hidden_size", None)
    dtype = getattr(model_config, "dtype", None)
    if not isinstance(hidden, int) or hidden <= 0 or dtype is None:
        return 0, ""
    vision = getattr(getattr(model_config, "hf_config", None), "vision_config", None)
    deepstack = getattr(vision, "deepstack_visual_indexes", None) or ()
    return hidden * (1 + len(deepstack)), str(dtype)
