"""Text to token ids and back without transformers (chapter 一次请求的一生).

transformers builds a GGUF's tokenizer from the file's metadata (its vocabulary, merges, special
tokens and chat template) once, and minillm saves the result as Hugging Face's files in its cache
(``minillm.engine.gguf_file.gguf_tokenizer``). :class:`Tokenizer` reads those files back with the
``tokenizers`` library, the Rust tokenizer that transformers' fast tokenizers wrap, and renders
the chat template with jinja2 in a sandbox, as transformers does. Importing transformers is a
large part of a fresh process's start (it indexes hundreds of model modules), so a command that
starts afresh pays for it only the first time.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import tokenizers

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # what templates may name


class Tokenizer:
    """The tokenizer saved in ``folder`` (``tokenizer.json``, ``tokenizer_config.json`` and the
    chat template, in ``chat_template.jinja`` or in the config), with the methods of
    transformers' tokenizers that minillm calls."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.name_or_path = str(folder)
        self.backend_tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        template_file = folder / "chat_template.jinja"
        self.chat_template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                              else config.get("chat_template"))
        self.special_tokens = {name: _content(config[name]) for name in SPECIAL_TOKENS if config.get(name)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``. Through ``encode_batch``, which lets go of the GIL while it
        works (``encode`` holds it): a server's event loop goes on answering meanwhile."""
        (encoding,) = self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self.backend_tokenizer.id_to_token(t) for t in token_ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        """The vocabulary's size, special tokens included."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str | list[int]:
        """The conversation rendered by the chat template (its special tokens by name, as
        transformers passes them); its token ids when ``tokenize``."""
        if not self.chat_template:
            raise ValueError(f"the tokenizer in {self.name_or_path} has no chat template")
        text = _compiled(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    **self.special_tokens)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def huggingface(self):
        """The same tokenizer as a transformers one, for libraries that take only those
        (xgrammar); imports transformers."""
        from transformers import PreTrainedTokenizerFast

        backend = tokenizers.Tokenizer.from_str(self.backend_tokenizer.to_str())
        return PreTrainedTokenizerFast(tokenizer_object=backend, **self.special_tokens)


def _content(token) -> str:
    """A special token as the config writes it: its text, or an added token's record."""
    return token["content"] if isinstance(token, dict) else token


@lru_cache(maxsize=8)
def _compiled(template: str):
    """A chat template compiled in jinja2's immutable sandbox with what transformers gives
    templates: trimmed blocks, loop controls, ``raise_exception``, ``strftime_now`` and a
    ``tojson`` that leaves non-ASCII text and HTML characters as they are."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)
