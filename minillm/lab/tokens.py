"""Count the tokens yourself (chapter 一次请求的一生): real tokenizers on real text.

The pinned PyPI package ``mistral-common`` ships tokenizers as data files. Two of them are used
here: Mistral-7B's SentencePiece model (``tokenizer.model.v1``, a 32,000-token vocabulary) and
Mistral NeMo's Tekken (``tekken_240718.json``, a byte-level BPE of 131,072 tokens); the lab counts
with them and with the real SmolLM2's own tokenizer. The text is the book's own, in
``data/texts/``: an excerpt of a service contract, a question about it and the opening question of
chapter 1, in Chinese and in English, saying the same thing, and the other questions the
colleagues of chapter 1 ask (English only, as the real SmolLM2 is). :func:`contract_prompt` builds
the book's long request from that contract. Nothing here reaches the network.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TEXTS_DIR = Path(__file__).resolve().parents[2] / "data" / "texts"
TEXTS = {  # file stem -> (what it is, language)
    "contract_zh": ("合同节选", "中文"),
    "contract_en": ("合同节选", "英文"),
    "question_zh": ("提问", "中文"),
    "question_en": ("提问", "英文"),
    "scene_zh": ("开场的提问", "中文"),
    "scene_en": ("开场的提问", "英文"),
}


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer that ``mistral-common`` ships: its model, kind, vocabulary and data file."""

    model: str  # the model family that uses it
    kind: str  # "SentencePiece" or "Tekken"
    vocab_size: int
    file: str  # the data file inside mistral_common/data
    encode: Callable[[str], list[int]]


@functools.cache
def tokenizers() -> tuple[Tokenizer, ...]:
    """Mistral-7B's SentencePiece and Mistral NeMo's Tekken, loaded from the package's data."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    out = []
    shipped = (("Mistral-7B", "SentencePiece", MistralTokenizer.v1, "tokenizer.model.v1"),
               ("Mistral NeMo", "Tekken", lambda: MistralTokenizer.v3(is_tekken=True), "tekken_240718.json"))
    for model, kind, load, file in shipped:
        raw = load().instruct_tokenizer.tokenizer
        out.append(Tokenizer(model, kind, raw.n_words, file,
                             functools.partial(raw.encode, bos=False, eos=False)))
    return tuple(out)


def sample_text(name: str) -> str:
    """The text of ``data/texts/<name>.txt`` (one of :data:`TEXTS`), without its final newline."""
    if name not in TEXTS:
        raise ValueError(f"no sample text {name!r} (known: {', '.join(TEXTS)})")
    return (TEXTS_DIR / f"{name}.txt").read_text(encoding="utf-8").strip()


def colleague_questions() -> list[str]:
    """The colleagues' questions of chapter 1, in English: the opening one (``scene_en``) first,
    then ``data/texts/colleagues_en.txt``, one a line."""
    others = (TEXTS_DIR / "colleagues_en.txt").read_text(encoding="utf-8").splitlines()
    return [sample_text("scene_en"), *filter(None, others)]


CONTRACT_INTRO = "Here is an excerpt of our service contract with Party B.\n\n"


def contract_prompt(engine, tokens: int, question: str | None = None) -> list[int]:
    """The book's long request as token ids of exactly ``tokens``: the English contract excerpt
    (repeated as often as needed, cut to length) and then ``question`` (default ``question_en``),
    through ``engine``'s tokenizer and chat template (an ``LLM`` of a model that has both)."""
    question = sample_text("question_en") if question is None else question
    slot = "\x00"  # where the user's message goes in the rendered template
    template = engine.tokenizer.apply_chat_template([{"role": "user", "content": slot}], tokenize=False,
                                                    add_generation_prompt=True)
    before, after = template.split(slot)
    encode = functools.partial(engine.tokenizer.encode, add_special_tokens=False)
    head, tail = encode(before + CONTRACT_INTRO), encode("\n\n" + question + after)
    room = tokens - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"{tokens} tokens cannot hold the chat template and the question "
                         f"({len(head) + len(tail)} tokens)")
    excerpt = sample_text("contract_en")
    copies = room // len(encode(excerpt)) + 2
    return head + encode("\n\n".join([excerpt] * copies))[:room] + tail
