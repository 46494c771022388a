"""A small byte-level BPE tokenizer with the Qwen2-VL special tokens, trained offline."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def chatml_template(image: str, video: str = "") -> str:
    """ChatML turns with a default system turn; each image part becomes ``image`` (each
    video part ``video``, if given). Qwen2-VL's convention with its vision markers."""
    video_part = f"{{% elif part['type'] == 'video' %}}{video}" if video else ""
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' or part['type'] == 'image_url' %}}{image}"
        f"{video_part}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CHAT_TEMPLATE = chatml_template(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
)

_WORDS = (
    "the a an image picture photo page document chart table figure shows describe "
    "what which where who how many colour color red green blue yellow black white "
    "circle square triangle star line dot left right top bottom middle center first "
    "second third last number letter digit text word answer question yes no is are "
    "there in on of and or with without than more less same different compare count "
    "you assistant user system helpful please tell me about this that these those "
    "one two three four five six seven eight nine ten zero cat dog car tree house "
    "sky sun moon water road person man woman child small large big tiny bright dark "
    "purple orange pink cyan shape shapes image images has have where kind few words "
    "Image What Which Where answer questions background grey brown navy olive teal maroon"
).split()


def training_corpus(seed: int, num_lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English lines (words, digits, punctuation) for BPE training."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!,:"))
    return lines


def build_tokenizer(seed: int, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on :func:`training_corpus` and wrap it for transformers.

    The special tokens take ids ``0 .. len(SPECIAL_TOKENS) - 1`` in the order above.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(training_corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
