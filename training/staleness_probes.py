"""Learning curves of full-prefill accuracy against plain-reuse accuracy, per task variant.

    python -m training.staleness_probes --variants qfirst,repeat --steps 400 \
        --out-dir training/results/staleness-probes

Issue 25: on ``models/fidelity-qwen2-vl-marked`` plain reuse (image KV computed in
another context, re-positioned, nothing refreshed) changes no answer, so refresh
methods cannot be ranked. Each probe fine-tunes a copy of that checkpoint (its
trained vision tower and retrieval; ``--init scratch`` starts from random weights)
on one variant of :mod:`training.staleness_tasks` for a short run on one thread,
and every ``--eval-every`` steps measures teacher-forced validation accuracy on
prompts of ``--eval-images`` images, with full prefill and with plain reuse from
each context of :mod:`training.stale_reuse` (another prefix and question, reverse
order, each image alone). ``--layers 8`` deepens the checkpoint first: each
trained layer is followed by a new one whose output projections start at zero, so
the deeper model starts out computing what the trained one does.

Results are merged by probe name into ``staleness_probes.json`` and the table
``staleness_probes.md`` is rewritten from all of them. ``--append-to MODEL`` trains
a model on in phases: the probe starts from ``--checkpoint``, its weights replace
MODEL's, and its recipe, curve and command are appended to the ``phases`` of
MODEL's ``training.json`` (:func:`append_phase`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from harness.fidelity_task import KINDS, REMEMBER, two_turns
from sgl_mmkv.testing.make_tiny_model import build_untrained, save_checkpoint
from training.pretrain_vision import HEAD_READERS, pretrain_vision
from training.stale_reuse import CONTEXTS, staleness_accuracy
from training.staleness_tasks import VARIANT_NAMES, StaleExample, make_stale_example, stale_messages
from training.train_fidelity_model import (
    ALT_SYSTEM_PROMPTS,
    FIDELITY_SPEC,
    PREAMBLES,
    make_optimizer,
    training_step,
)

COMMITTED = Path("models/fidelity-qwen2-vl-marked")
KIND_DRAWS = 200  # a third of a kind-asking variant's prompts ask one
VARIANTS_WITHOUT_KINDS = ("repeat", "count")  # their answers are backgrounds and counts


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """One probe: the variant, the starting weights and the short run's recipe."""

    variant: str
    steps: int
    batch_size: int
    lr: float
    min_images: int
    max_images: int
    eval_images: int
    eval_every: int
    num_validation: int
    seed: int
    init: str  # "committed" or "scratch"
    layers: int
    # fraction of training prompts shown as a second turn, after a first turn that
    # showed the same images in another order (the turn_reordered scenario)
    turn_fraction: float = 0.0
    # image side in pixels the processor resizes every image to (0: the checkpoint's);
    # 224 gives (224 / 28) ** 2 = 64 tokens per image
    image_side: int = 0
    # share of training prompts drawn again until they ask a shape kind (the question a
    # 64-token image makes hardest), on top of the third that ask one anyway (0.5 gives
    # about 0.67 kind questions); 0 draws nothing extra, so old recipes replay
    kind_fraction: float = 0.0
    # train the decoder only, the vision tower as it is after any attribute pretraining
    freeze_vision: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.kind_fraction <= 1.0:
            raise ValueError("kind_fraction is a share, from 0 to 1")
        if self.kind_fraction and self.variant in VARIANTS_WITHOUT_KINDS:
            raise ValueError(f"kind_fraction: {self.variant} never asks a shape kind")

    @property
    def name(self) -> str:
        init = "" if self.init == "committed" else f"-{self.init}"
        depth = "" if self.layers == FIDELITY_SPEC.num_layers else f"-{self.layers}L"
        turns = f"-turns{self.turn_fraction:g}" if self.turn_fraction else ""
        side = f"-{self.image_side}px" if self.image_side else ""
        kind = f"-kind{self.kind_fraction:g}" if self.kind_fraction else ""
        frozen = "-frozen" if self.freeze_vision else ""
        return f"{self.variant}{depth}{init}{turns}{side}{kind}{frozen}"


def deepen(model, layers: int):
    """A ``layers``-layer copy of the 4-layer ``model``: trained layer i becomes layer
    ``i * layers // 4``; the others are new, with ``o_proj`` and ``down_proj`` zeroed
    (each adds nothing to the residual stream until trained)."""
    old = model.config.text_config.num_hidden_layers
    if layers % old:
        raise ValueError(f"layers must be a multiple of {old}")
    spec = replace(FIDELITY_SPEC, num_layers=layers)
    deep, _ = build_untrained("qwen2_vl", spec, seed=0)
    state = {k: v for k, v in model.state_dict().items() if ".layers." not in k}
    stride = layers // old
    for key, value in model.state_dict().items():
        if ".language_model.layers." in key:
            prefix, rest = key.split(".language_model.layers.")
            index, tail = rest.split(".", 1)
            state[f"{prefix}.language_model.layers.{int(index) * stride}.{tail}"] = value
    missing, unexpected = deep.load_state_dict(state, strict=False)
    if unexpected or any(".layers." not in k for k in missing):
        raise RuntimeError(f"state dict mismatch: {unexpected} {missing}")
    for index, layer in enumerate(deep.model.language_model.layers):
        if index % stride:
            torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
            torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    return deep


def set_image_side(processor, side: int) -> None:
    """Make ``processor`` resize every image to ``side`` x ``side`` pixels."""
    pixels = side * side
    image_processor = processor.image_processor
    image_processor.min_pixels = image_processor.max_pixels = pixels
    image_processor.size = {"shortest_edge": pixels, "longest_edge": pixels}


def load_model(config: ProbeConfig, checkpoint: Path):
    """(model, processor) the probe starts from."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    if config.image_side:
        set_image_side(processor, config.image_side)
    if config.init == "scratch":
        model, _ = build_untrained("qwen2_vl", replace(FIDELITY_SPEC, num_layers=config.layers), 0)
        return model, processor
    model = AutoModelForImageTextToText.from_pretrained(checkpoint).to(torch.float32)
    if config.layers != model.config.text_config.num_hidden_layers:
        model = deepen(model, config.layers)
    return model, processor


def training_batch(
    processor, examples: list[StaleExample], rng: random.Random, turn_fraction: float = 0.0
) -> dict:
    """A padded batch (varied system prompt and preamble) whose labels are the answers.

    ``turn_fraction`` of the prompts are second turns: a first turn shows the same
    images in a random other order (question :data:`REMEMBER`), then the prompt."""
    texts, images, starts = [], [], []
    for example in examples:
        ims: list = []

        def part(image, ims=ims) -> dict:
            ims.append(image)
            return {"type": "image"}

        system = rng.choice(ALT_SYSTEM_PROMPTS)
        earlier = None
        if turn_fraction and rng.random() < turn_fraction:  # no draw: old recipes replay
            order = list(range(len(example.images)))
            while len(order) > 1 and order == sorted(order):
                rng.shuffle(order)
            earlier = stale_messages(example, part, system=system, order=order, question=REMEMBER)
        messages = stale_messages(example, part, system=system, preamble=rng.choice(PREAMBLES))
        if earlier is not None:
            messages = two_turns(earlier, messages[1])
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        texts.append(prompt + example.answer + "<|im_end|>\n")
        images.extend(ims)
        starts.append((len(processor.tokenizer(prompt)["input_ids"]), len(ims)))
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    if processor.tokenizer.padding_side != "right":
        raise AssertionError("labels assume right padding")
    labels = torch.full_like(batch["input_ids"], -100)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for row, (text_start, count) in enumerate(starts):
        # each image's one pad in the text expands to its tokens; the prompt is prefix-stable
        start = text_start + int((batch["input_ids"][row] == pad).sum()) - count
        end = int(batch["attention_mask"][row].sum())
        labels[row, start:end] = batch["input_ids"][row, start:end]
    batch["labels"] = labels
    return batch


def draw_training_example(config: ProbeConfig, rng: random.Random) -> StaleExample:
    """One training prompt; with probability ``config.kind_fraction`` one that asks a
    shape kind (drawn again until it does)."""
    want_kind = config.kind_fraction > 0 and rng.random() < config.kind_fraction
    for _ in range(KIND_DRAWS):
        example = make_stale_example(
            config.variant,
            "train",
            rng.randrange(10**9),
            rng.randint(config.min_images, config.max_images),
        )
        if not want_kind or example.answer in KINDS:
            return example
    raise ValueError(f"--kind-fraction: variant {config.variant!r} asks no shape kinds")


def run_probe(
    config: ProbeConfig,
    checkpoint: Path = COMMITTED,
    save: Path | None = None,
    threads: int = 1,
    vision_pretrain_steps: int = 0,
    vision_pretrain_lr: float = 3e-4,
    vision_reader: str = "flat",
) -> dict:
    """Fine-tune (or train) for ``config.steps`` steps; the curve of full and reuse accuracy.
    ``save``: write the trained model there as a checkpoint with ``training.json``.
    ``vision_pretrain_steps`` > 0 first trains the vision tower alone on the images'
    attributes (:func:`training.pretrain_vision.pretrain_vision` at ``vision_pretrain_lr``,
    its heads reading the tokens by ``vision_reader``)."""
    torch.set_num_threads(threads)
    torch.manual_seed(config.seed)
    model, processor = load_model(config, checkpoint)
    validation = [
        make_stale_example(config.variant, "validation", i, config.eval_images)
        for i in range(config.num_validation)
    ]
    vision_pretrain = None
    if vision_pretrain_steps > 0:
        vision_pretrain = pretrain_vision(
            model,
            processor,
            vision_pretrain_steps,
            lr=vision_pretrain_lr,
            seed=config.seed,
            reader=vision_reader,
        )
    if config.freeze_vision:
        for parameter in model.model.visual.parameters():
            parameter.requires_grad_(False)
            parameter.grad = None  # none left from the pretraining above
    rng = random.Random(config.seed)
    optimizer, schedule = make_optimizer(model, config.lr, max(config.steps, 1))
    started = time.monotonic()
    curve = []

    def evaluate(step: int, loss: float | None) -> None:
        point = {"step": step, "loss": loss, **staleness_accuracy(model, processor, validation)}
        point["s"] = round(time.monotonic() - started)
        curve.append(point)
        print(json.dumps({"probe": config.name, **point}), flush=True)

    evaluate(0, None)
    model.train()
    for step in range(1, config.steps + 1):
        examples = [draw_training_example(config, rng) for _ in range(config.batch_size)]
        batch = training_batch(processor, examples, rng, config.turn_fraction)
        loss = training_step(model, batch, optimizer, schedule)
        if step % config.eval_every == 0 or step == config.steps:
            evaluate(step, round(loss.item(), 4))
    result = {"name": config.name, "config": asdict(config), "curve": curve}
    if vision_pretrain is not None:
        result["vision_pretrain"] = vision_pretrain
    if save is not None:
        save_model(model, config, checkpoint, save, result)
    return result


def saved_spec(config: ProbeConfig):
    """The model spec :func:`save_model` writes for a probe of ``config``."""
    spec = replace(FIDELITY_SPEC, num_layers=config.layers)
    if config.image_side:
        spec = replace(spec, min_pixels=config.image_side**2, max_pixels=config.image_side**2)
    return spec


def save_model(model, config: ProbeConfig, checkpoint: Path, out: Path, result: dict) -> None:
    """``model`` as a plain Qwen2-VL checkpoint, with the recipe and curve in ``training.json``."""
    from transformers import AutoTokenizer

    spec = saved_spec(config)
    model.eval()
    save_checkpoint(model, AutoTokenizer.from_pretrained(checkpoint), "qwen2_vl", spec, out)
    record = {
        "arch": "qwen2_vl",
        "spec": asdict(spec),
        "style": f"staleness-{config.variant}",
        "init_from": None if config.init == "scratch" else str(checkpoint),
        "total_steps": config.steps,
        "total_train_seconds": result["curve"][-1]["s"],
        **result,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def markdown(results: dict[str, dict]) -> str:
    """The table: one row per probe and evaluated step."""
    lines = [
        "Teacher-forced validation accuracy (answer tokens all argmax) with full prefill "
        "and with plain reuse (refresh budget 0) of every image's KV from another context: "
        "`prefix` = another system prompt and preamble (question-first variants: and "
        "another question), `reordered` = images in reverse order, `alone` = each image "
        "in a prompt of its own. Gap = full minus the worst reuse context.",
        "",
        "| probe | init | eval images | n | step | loss | full | "
        + " | ".join(f"reuse {c}" for c in CONTEXTS)
        + " | gap | seconds |",
        "|---|---|---|---|---|---|---|" + "---|" * len(CONTEXTS) + "---|---|",
    ]
    for name, result in results.items():
        config = result["config"]
        init = config["init"] + ("" if config["layers"] == 4 else f", {config['layers']} layers")
        for point in result["curve"]:
            gap = point["full"] - min(point[c] for c in CONTEXTS)
            loss = "-" if point["loss"] is None else f"{point['loss']:.3f}"
            cells = " | ".join(f"{point[c]:.3f}" for c in CONTEXTS)
            lines.append(
                f"| {name} | {init} | {config['eval_images']} | {config['num_validation']} | "
                f"{point['step']} | {loss} | {point['full']:.3f} | {cells} | {gap:+.3f} | "
                f"{point['s']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="qfirst,repeat,count")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-images", type=int, default=2)
    parser.add_argument("--max-images", type=int, default=4)
    parser.add_argument("--eval-images", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--num-validation", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", choices=("committed", "scratch"), default="committed")
    parser.add_argument("--layers", type=int, default=FIDELITY_SPEC.num_layers)
    parser.add_argument(
        "--turn-fraction",
        type=float,
        default=0.0,
        help="fraction of training prompts shown as a second turn after the same images "
        "in another order",
    )
    parser.add_argument(
        "--image-side", type=int, default=0, help="resize images to this many pixels a side"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--vision-pretrain-steps", type=int, default=0, help="attribute pretraining of the tower"
    )
    parser.add_argument("--vision-pretrain-lr", type=float, default=3e-4)
    parser.add_argument(
        "--vision-reader",
        choices=HEAD_READERS,
        default="flat",
        help="how the pretraining heads read an image's tokens",
    )
    parser.add_argument(
        "--kind-fraction",
        type=float,
        default=0.0,
        help="share of training prompts drawn again until they ask a shape kind",
    )
    parser.add_argument(
        "--freeze-vision", action="store_true", help="train the decoder only (after pretraining)"
    )
    parser.add_argument(
        "--checkpoint", type=Path, help=f"weights to start from (default {COMMITTED})"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("training/results/staleness-probes"))
    parser.add_argument("--save", type=Path, help="write the trained model here (one variant)")
    parser.add_argument(
        "--append-to",
        type=Path,
        help="a model with a training.json: the trained weights replace its own and the "
        "run is appended to its phases (one variant)",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANT_NAMES))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANT_NAMES)}")
    if args.save is not None and len(names) != 1:
        parser.error("--save takes exactly one variant")
    try:
        configs = [_config_of(args, name) for name in names]
    except ValueError as error:
        parser.error(f"--{error}".replace("_", "-", 1))
    previous = None
    if args.append_to is not None:
        try:
            previous = _appendable(args, configs)
        except ValueError as error:
            parser.error(f"--append-to: {error}")
    checkpoint = args.checkpoint or args.append_to or COMMITTED
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record_path = args.out_dir / "staleness_probes.json"
    results = json.loads(record_path.read_text()) if record_path.exists() else {}
    command = "python -m training.staleness_probes " + " ".join(argv or sys.argv[1:])
    for config in configs:
        staging = None if previous is None else Path(tempfile.mkdtemp(dir=args.append_to.parent))
        result = run_probe(
            config,
            checkpoint,
            args.save or staging,
            args.threads,
            args.vision_pretrain_steps,
            args.vision_pretrain_lr,
            args.vision_reader,
        )
        result["command"] = command
        if staging is not None:
            latest = json.loads((staging / "training.json").read_text())
            record = append_phase(previous, latest, str(checkpoint), command)
            (staging / "training.json").write_text(json.dumps(record, indent=2) + "\n")
            for item in staging.iterdir():  # the model's files replaced once all are written
                os.replace(item, args.append_to / item.name)
            staging.rmdir()
        results[result["name"]] = result
        record_path.write_text(json.dumps(results, indent=2) + "\n")
        (args.out_dir / "staleness_probes.md").write_text(markdown(results))
    print(markdown(results))
    return 0


PHASE_FIELDS = ("init_from", "config", "curve", "vision_pretrain", "total_train_seconds", "command")


def append_phase(previous: dict, latest: dict, init_from: str, command: str) -> dict:
    """The training record of a model trained on by one more phase.

    Args:
        previous: the model's ``training.json`` before the phase (a record without
            ``phases`` becomes the first phase).
        latest: the record :func:`save_model` wrote for the phase.
        init_from: the weights the phase started from; command: its command line.

    The top level describes the model as it now is (the last phase's config, curve
    and spec; the latest tower pretraining of any phase); ``phases`` lists every
    phase in order, and the totals sum them.
    """
    phases = list(previous.get("phases") or [_phase(previous)])
    phases.append(_phase({**latest, "init_from": init_from, "command": command}))
    record = dict(previous)  # a tower pretrained in an earlier phase is still the model's
    described = ("name", "style", "spec", "config", "curve")
    record.update({key: latest[key] for key in described if key in latest})
    if "vision_pretrain" in latest:
        record["vision_pretrain"] = latest["vision_pretrain"]
    record["total_steps"] = sum(phase["config"]["steps"] for phase in phases)
    record["total_train_seconds"] = sum(phase["total_train_seconds"] for phase in phases)
    record["phases"] = phases
    return record


def _appendable(args: argparse.Namespace, configs: list[ProbeConfig]) -> dict:
    """``args.append_to``'s training record, if the run can be appended to it: one
    variant trained on from the model itself, saved with the model's own spec."""
    model = args.append_to
    if args.save is not None or len(configs) != 1:
        raise ValueError("takes exactly one variant and no --save")
    if args.checkpoint is not None and args.checkpoint.resolve() != model.resolve():
        raise ValueError("trains on from the model itself: leave --checkpoint out")
    if configs[0].init == "scratch":
        raise ValueError("trains on from the model's weights, not --init scratch")
    path = model / "training.json"
    if not path.exists():
        raise ValueError(f"no training.json in {model}")
    previous = json.loads(path.read_text())
    phases = previous.get("phases") or [previous]
    if not all("config" in phase and "total_train_seconds" in phase for phase in phases):
        raise ValueError(f"{path} is not a record of training.staleness_probes")
    spec, saved = asdict(saved_spec(configs[0])), previous.get("spec", {})
    changed = [k for k in ("num_layers", "min_pixels", "max_pixels") if saved.get(k) != spec[k]]
    if changed:
        found = ", ".join(f"{key}={saved.get(key)}" for key in changed)
        raise ValueError(f"the model was saved with {found}; pass --image-side / --layers to match")
    return previous


def _phase(record: dict) -> dict:
    return {key: record[key] for key in PHASE_FIELDS if key in record}


def _config_of(args: argparse.Namespace, variant: str) -> ProbeConfig:
    """The probe of ``variant`` the command line asks for (ValueError if it is invalid)."""
    return ProbeConfig(
        variant,
        args.steps,
        args.batch_size,
        args.lr,
        args.min_images,
        args.max_images,
        args.eval_images,
        args.eval_every,
        args.num_validation,
        args.seed,
        args.init,
        args.layers,
        args.turn_fraction,
        args.image_side,
        args.kind_fraction,
        args.freeze_vision,
    )


if __name__ == "__main__":
    sys.exit(main())
