"""Structured output (chapter: serving over HTTP): JSON that a grammar allows, one token at a time.

A request with :class:`StructuredOutputsParams` (vLLM's name) carries a JSON schema, or asks for
any JSON object. The schema is compiled once into a grammar over the model's vocabulary by
xgrammar (vLLM's default backend); a bad schema is a ``ValueError`` before the request is queued.
Each such request gets its own ``GrammarMatcher``, which knows where in the grammar its output
stands. Before sampling, :meth:`StructuredOutputs.mask` asks each matcher for the tokens the grammar
allows next (a bitmask over the vocabulary, filled on the CPU) and sets every other logit to -inf;
after sampling, :meth:`StructuredOutputs.accept` moves each matcher past its sampled token. Once the
JSON is complete the grammar allows only the end-of-sequence token, which ends the request.

xgrammar is imported on the first structured request, so an engine that never sees one never
loads it.
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import torch

from minillm.engine.tokenizer import Tokenizer

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what json_object means (vLLM compiles the same schema)
COMPILER_CACHE_BYTES = 512 * 2**20  # compiled grammars kept, by schema (vLLM's VLLM_XGRAMMAR_CACHE_MB)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must be: valid for the JSON schema ``json`` (a dict or its JSON
    text), or any JSON object (``json_object=True``). Exactly one of the two."""

    json: dict | str | None = None
    json_object: bool = False

    def __post_init__(self):
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (a dict or its JSON text), got {type(self.json).__name__}")
        if (self.json is not None) == self.json_object:
            raise ValueError("structured outputs take exactly one of json (a JSON schema) and json_object=True")

    @property
    def schema(self) -> str:
        """The JSON schema as text, the grammar compiler's input."""
        if self.json_object:
            return JSON_OBJECT_SCHEMA
        return self.json if isinstance(self.json, str) else json.dumps(self.json)


class StructuredOutputs:
    """The grammar compiler for one model's tokenizer and the matcher of each structured request.

    ``tokenizer``: the tokenizer the engine has, transformers' or minillm's (None: structured
    requests refused; xgrammar reads the vocabulary through a transformers one);
    ``vocab_size``: the logits' width (the grammar masks ids past the tokenizer's too);
    ``eos_token_ids``: the tokens that end a request, the only ones allowed once the JSON is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.matchers: dict = {}  # request_id -> its xgrammar GrammarMatcher
        self._compiler = None
        self._lock = threading.Lock()  # the compiler is built once, whichever thread asks first

    def compile(self, params: StructuredOutputsParams):
        """The grammar for ``params`` (xgrammar caches it by schema); ``ValueError`` naming what is
        wrong with the schema. Safe to call from any thread."""
        compiler = self._get_compiler()
        try:
            return compiler.compile_json_schema(params.schema)
        except RuntimeError as err:  # xgrammar: "[time] file.cc:line: message"
            message = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(err).strip())
            raise ValueError(f"invalid JSON schema: {message}") from None

    def _get_compiler(self):
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this model has none")
        with self._lock:
            if self._compiler is None:
                import xgrammar

                tokenizer = self.tokenizer.huggingface() if isinstance(self.tokenizer, Tokenizer) else self.tokenizer
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids))
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=COMPILER_CACHE_BYTES)
            return self._compiler

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        """A matcher at the start of the grammar for a request about to be queued."""
        import xgrammar

        self.matchers[request_id] = xgrammar.GrammarMatcher(self.compile(params))

    def drop(self, request_id: str) -> None:
        """Free a finished or aborted request's matcher (nothing if it had none)."""
        self.matchers.pop(request_id, None)

    def fill(self, request_ids: list[str]) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask of the tokens each structured row's grammar allows next (on the CPU, one
        row per request id) and those rows; None when no row is structured."""
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self.matchers]
        if not rows:
            return None
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(request_ids), self.vocab_size)
        for row in rows:
            self.matchers[request_ids[row]].fill_next_token_bitmask(bitmask, row)
        return bitmask, rows

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """-inf, in place, for the logits of ``rows`` whose bit is 0 (on the logits' device)."""
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                             indices=rows)

    def accept(self, request_ids: list[str], token_ids: list[int]) -> None:
        """Move each structured request's matcher past its sampled token (others: nothing)."""
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            matcher = self.matchers.get(request_id)
            if matcher is not None and not matcher.accept_token(token_id):
                raise RuntimeError(f"request {request_id!r}: the grammar refused token {token_id}, "
                                   f"which its own mask allowed")
