"""Plain reuse (refresh budget 0) of image KV simulated in torch, and teacher-forced scoring.

A reuse context is another prompt holding the same images (another prefix or
question, another order, or each image alone). Hooks on every decoder layer's
``k_proj`` and ``v_proj`` record the images' keys and values (before rotary) in
that context; scoring the target prompt then overwrites its image positions'
keys and values with the recorded ones, layer by layer. Rotary is applied after
``k_proj``, at the target prompt's positions, which is exactly re-positioning the
reused keys by the M-RoPE delta. Text tokens are computed fresh and see only the
stale image KV: what a server reusing every image token and refreshing none does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.fidelity import OTHER_PREAMBLE, OTHER_SYSTEM
from training.staleness_tasks import StaleExample, stale_messages

CONTEXTS = ("prefix", "reordered", "alone")


def _local_part(images: list) -> Callable[..., dict]:
    def part(image) -> dict:
        images.append(image)
        return {"type": "image"}

    return part


@dataclass(slots=True)
class Encoded:
    """A rendered prompt (with the answer appended when given)."""

    inputs: dict
    prompt_tokens: int
    image_token_id: int

    def image_positions(self) -> torch.Tensor:
        return (self.inputs["input_ids"][0] == self.image_token_id).nonzero().flatten()


def encode(processor, messages: list[dict], images: list, answer: str | None = None) -> Encoded:
    """Tokenise ``messages`` (+ ``answer<|im_end|>\\n``) with the model's processor."""
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    text = prompt if answer is None else prompt + answer + "<|im_end|>\n"
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # each image's one pad in the text expands to its tokens; the prompt is prefix-stable
    shift = int((inputs["input_ids"][0] == pad).sum()) - len(images)
    prompt_tokens = len(processor.tokenizer(prompt)["input_ids"]) + shift
    return Encoded(dict(inputs), prompt_tokens, pad)


class KVSplicer:
    """Forward hooks on the decoder's ``k_proj`` / ``v_proj``: record, or overwrite,
    the outputs at given positions (batch of one)."""

    def __init__(self, model) -> None:
        self.positions: torch.Tensor | None = None
        self.record: list[dict[str, torch.Tensor]] | None = None
        self.replace: list[dict[str, torch.Tensor]] | None = None
        self.handles = []
        for index, layer in enumerate(model.model.language_model.layers):
            for name in ("k", "v"):
                module = getattr(layer.self_attn, f"{name}_proj")
                self.handles.append(module.register_forward_hook(self._hook(index, name)))

    def _hook(self, index: int, name: str):
        def hook(_module, _inputs, output):
            if self.positions is None:
                return None
            if self.record is not None:
                while len(self.record) <= index:
                    self.record.append({})
                self.record[index][name] = output[0, self.positions].detach().clone()
                return None
            if self.replace is not None:
                output = output.clone()
                output[0, self.positions] = self.replace[index][name]
                return output
            return None

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def record_image_kv(model, splicer: KVSplicer, encoded: Encoded) -> list[dict[str, torch.Tensor]]:
    """Per layer ``{"k", "v"}``: ``(image tokens, kv dim)``, the prompt's images in order."""
    splicer.positions, splicer.record = encoded.image_positions(), []
    try:
        model(**encoded.inputs)
        return splicer.record
    finally:
        splicer.positions, splicer.record = None, None


def _per_image(kv: list[dict[str, torch.Tensor]], count: int) -> list[list[dict]]:
    """Split recorded KV into one per-layer list per image (prompt order; every image
    of a prompt has the same token count, the processor's fixed size)."""
    span, rest = divmod(kv[0]["k"].shape[0], count)
    if rest:
        raise ValueError(f"{kv[0]['k'].shape[0]} image tokens do not split into {count} images")
    return [
        [{n: t[i * span : (i + 1) * span] for n, t in layer.items()} for layer in kv]
        for i in range(count)
    ]


def context_image_kv(model, processor, splicer: KVSplicer, example: StaleExample, context: str):
    """Per image (example order), per layer, the KV the images get in ``context``."""
    n = len(example.images)
    if context == "alone":
        result = []
        for image in example.images:
            single = StaleExample("alone", (image,), "", "", False, "")
            images: list = []
            messages = stale_messages(single, _local_part(images))
            messages[1]["content"] = messages[1]["content"][:-1]  # no question
            kv = record_image_kv(model, splicer, encode(processor, messages, images))
            result.append(_per_image(kv, 1)[0])
        return result
    images = []
    if context == "prefix":
        order = list(range(n))
        messages = stale_messages(
            example,
            _local_part(images),
            system=OTHER_SYSTEM,
            preamble=OTHER_PREAMBLE,
            question=example.other_question,
        )
    elif context == "reordered":
        order = list(reversed(range(n)))
        messages = stale_messages(example, _local_part(images), order=order)
    else:
        raise ValueError(f"unknown context {context!r}; choose from {', '.join(CONTEXTS)}")
    per_image = _per_image(record_image_kv(model, splicer, encode(processor, messages, images)), n)
    by_example = [None] * n
    for slot, i in enumerate(order):
        by_example[i] = per_image[slot]
    return by_example


@torch.no_grad()
def answer_correct(model, splicer: KVSplicer, encoded: Encoded, image_kv=None) -> bool:
    """Teacher-forced exact match of the answer tokens; ``image_kv`` (per image, per
    layer) replaces the prompt's image KV first (plain reuse)."""
    if image_kv is not None:
        splicer.positions = encoded.image_positions()
        splicer.replace = [
            {n: torch.cat([image[layer][n] for image in image_kv]) for n in ("k", "v")}
            for layer in range(len(image_kv[0]))
        ]
    try:
        logits = model(**encoded.inputs).logits[0]
    finally:
        splicer.positions, splicer.replace = None, None
    ids = encoded.inputs["input_ids"][0]
    start = encoded.prompt_tokens
    predicted = logits[start - 1 : len(ids) - 1].argmax(-1)
    return bool((predicted == ids[start:]).all())


def staleness_accuracy(
    model, processor, examples: list[StaleExample], contexts: tuple[str, ...] = CONTEXTS
) -> dict[str, float]:
    """``{"full": acc, context: acc under plain reuse from that context, ...}``."""
    was_training = model.training
    model.eval()
    splicer = KVSplicer(model)
    hits = {"full": 0, **{c: 0 for c in contexts}}
    try:
        for example in examples:
            images: list = []
            messages = stale_messages(example, _local_part(images))
            target = encode(processor, messages, images, example.answer)
            hits["full"] += answer_correct(model, splicer, target)
            for context in contexts:
                kv = context_image_kv(model, processor, splicer, example, context)
                hits[context] += answer_correct(model, splicer, target, kv)
    finally:
        splicer.close()
        model.train(was_training)
    return {name: round(count / len(examples), 4) for name, count in hits.items()}
