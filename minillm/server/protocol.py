"""The OpenAI API's request bodies and errors, as vLLM's server takes them (chapter: serving over HTTP).

The pydantic models check types only (strictly: ``true`` is no token id, ``1.5`` no ``max_tokens``).
Values are checked once, by the engine's own ``SamplingParams``, whose ``ValueError`` becomes a
400 naming the field the client sent (``max_completion_tokens`` when that is how it asked).
Fields minillm cannot honour (``best_of``, ``suffix``, tools, ...) are refused by name rather
than silently ignored, and so is every field it does not know (``minillm`` refuses what vLLM would
log as ignored and drop: an answer computed without a setting the client sent is not the answer
it asked for). Every request model derives from :class:`Body`: a field sent as ``null`` counts as
not sent, at every level, and text with a lone surrogate (``"\\ud800"``: JSON allows it, Unicode
does not) is a 400 naming where it is. A few of OpenAI's fields that change nothing about the
answer (:data:`NO_EFFECT`: ``user``, ``metadata``, ``reasoning_effort``, ...) are taken and
ignored, and so are the values of :data:`HARMLESS` that ask for what minillm does anyway
(``tool_choice`` "none"); other values of it can never succeed and are a 400. ``response_format``
is text, a JSON object or JSON for a schema (structured output, through a grammar). Every error a client gets is an :class:`APIError`: an HTTP status, a ``reason`` for the
server's log and its ``request_rejected`` counter, and OpenAI's body
``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, FailFast, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

from minillm.engine.sampling import SamplingParams
from minillm.engine.structured import StructuredOutputsParams

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
UNSUPPORTED = ("echo", "suffix", "tools", "best_of")  # refused when on
UNSUPPORTED_OFF = {"best_of": 1}  # what else means "off" besides false, 0 and empty
MAX_N = 128  # answers per prompt at most (OpenAI's bound)
NO_EFFECT = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort",
             "prompt_cache_key", "safety_identifier")  # taken, ignored
HARMLESS = {"tool_choice": ("none", "auto")}  # and others: 400
REASONS = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
           499: "client_closed", 500: "internal_error", 503: "unavailable"}  # by status, by default
EXPECTED = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
            "stop": "a string or a list of strings",
            "content": "a string or a list of text parts"}  # said instead of pydantic's per-branch errors


class APIError(Exception):
    """An error for the client: HTTP ``status``, a message saying what to change, the field at
    fault, and the ``reason`` the server counts it under (default: by status, :data:`REASONS`)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, reason: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.reason = reason or REASONS.get(status, "error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def validation_error(err: ValidationError) -> APIError:
    """A 400 naming each bad field, from pydantic's errors."""
    by_field: dict[str, str] = {}
    for e in err.errors():
        loc = [str(part) for part in e["loc"]]
        field = loc[0] if loc else "body"
        if e["type"] == "lone_surrogate":
            by_field[e["ctx"]["field"]] = e["msg"]
        elif not loc and e["type"] != "missing":
            by_field[field] = "the request body must be a JSON object"
        elif field in EXPECTED:
            by_field[field] = f"must be {EXPECTED[field]}"
        else:
            by_field.setdefault(".".join(loc) or "body", e["msg"])
    message = "; ".join(f"{field}: {msg}" for field, msg in by_field.items())
    return APIError(400, message, param=next(iter(by_field)))


def _lone_surrogate(value, path: str = "") -> str | None:
    """Where in a parsed JSON value a string holds a lone surrogate, or None. One pass of the C
    encoder says whether there is one; only then is the value walked (ints skipped) to say where."""
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    if isinstance(value, str):
        return path or "body"
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(item, (str, list, dict)):
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
            found = _lone_surrogate(item, where)
            if found:
                return found
    return None


class Body(BaseModel):
    """A request body or a part of one: types checked strictly, ``null`` as not sent."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _text_and_nulls(cls, data):
        if not isinstance(data, dict):
            return data
        where = _lone_surrogate(data)
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "{field} holds a lone surrogate "
                                      "(U+D800..U+DFFF), which is not text: send valid Unicode",
                                      {"field": where})
        return {key: value for key, value in data.items() if value is not None}


class StreamOptions(Body):
    include_usage: bool = False  # a last chunk with the usage
    continuous_usage_stats: bool = False  # vLLM's extension: with include_usage, usage in every chunk


class JSONSchemaFormat(Body):
    """``response_format.json_schema``: OpenAI's name, description and strict flag (the schema is
    always enforced), and the schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """``response_format``: plain text, any JSON object, or JSON valid for a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise APIError(400, "response_format: json_schema ({name, schema}) goes with, and only with, "
                                "type 'json_schema'", param="response_format")
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return StructuredOutputsParams(json_object=True) if self.type == "json_object" else None


# every list is checked until its first wrong item: a wrong guess at a prompt's shape costs nothing,
# and a body of a million wrong items is one error, not a million
TokenIds = TypeAliasType("TokenIds", Annotated[list[int], FailFast()])
Texts = TypeAliasType("Texts", Annotated[list[str], FailFast()])
Batch = TypeAliasType("Batch", Annotated[list[TokenIds], FailFast()])


class GenerationRequest(Body):
    """What completions and chat completions share: sampling, stopping, streaming."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # vLLM's extension; None, 0 or -1: no limit
    seed: int | None = None
    stop: str | Texts | None = None
    stop_token_ids: TokenIds | None = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    min_tokens: int = 0  # vLLM's extension: no EOS, stop token or stop string before this many
    n: int = 1  # answers per prompt (their prompt's KV blocks shared)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    min_p: float = 0.0  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: token ids in each choice
    response_format: ResponseFormat | None = None  # JSON output, through a grammar

    def check_supported(self) -> None:
        """Refuse what minillm does not do, by name (400)."""
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be an int in [1, {MAX_N}], got n={self.n}", param="n")
        for name, value in (self.model_extra or {}).items():
            if name in NO_EFFECT or value in HARMLESS.get(name, ()):
                continue
            if name in HARMLESS:
                raise APIError(400, f"{name}={value!r} can never be met by minillm (it calls no "
                                    f"tools and writes plain text): send one of "
                                    f"{list(HARMLESS[name])} or leave it out", param=name,
                               reason="unsupported")
            if name not in UNSUPPORTED:
                raise APIError(400, f"unknown field {name!r}: minillm takes no such parameter "
                                    f"(remove it, or check its spelling)", param=name,
                               reason="unknown_field")
            if value and value != UNSUPPORTED_OFF.get(name):  # false, 0, empty: "off"
                raise APIError(400, f"{name} is not supported by minillm", param=name,
                               reason="unsupported")
        if self.stream_options is not None:
            unknown = [f"stream_options.{name}" for name in self.stream_options.model_extra or {}]
            if unknown:
                raise APIError(400, f"unknown field {unknown[0]!r}: stream_options takes "
                                    f"include_usage and continuous_usage_stats", param=unknown[0],
                               reason="unknown_field")
            if not self.stream:
                raise APIError(400, "stream_options can only be given with stream=true",
                               param="stream_options")

    @property
    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM: only together with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def max_tokens_field(self) -> str:
        """The name under which the client asked for a length, for its error messages."""
        return "max_tokens"

    @property
    def client_names(self) -> dict[str, str]:
        """``SamplingParams``' field names -> the client's, where they differ."""
        return {"max_tokens": self.max_tokens_field, "structured_outputs": "response_format"}

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token (the sampled token's logprob comes too); None: no logprobs."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token (its own logprob comes too); None: no prompt logprobs."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's params for one prompt; its ValueError as a 400 naming the client's field."""
        try:
            bias = {int(token): value for token, value in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, f"logit_bias: keys must be token ids, got {list(self.logit_bias)[:5]}",
                           param="logit_bias") from None
        with client_fields(self.client_names):
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k, max_tokens=max_tokens,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed, stop=tuple(self.stop_strings),
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, logit_bias=bias, min_p=self.min_p,
                logprobs=self.num_logprobs, prompt_logprobs=self.num_prompt_logprobs,
                structured_outputs=self.response_format and self.response_format.structured_outputs())


@contextmanager
def client_fields(client_names: dict[str, str] | None = None):
    """The engine's ValueError (its messages start with the field's name) as a 400 naming the field
    as the client sent it (``client_names``: the engine's name -> the client's)."""
    try:
        yield
    except ValueError as err:
        message = str(err)
        for engine_name, client_name in (client_names or {}).items():
            message = re.sub(rf"\b{engine_name}\b", client_name, message)
        raise APIError(400, message, param=message.split(" ", 1)[0].rstrip(":")) from None


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: one prompt or a list, as text or token ids."""

    prompt: Annotated[str | TokenIds | Texts | Batch, Field(union_mode="left_to_right")]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top logprobs per token, the sampled token's besides
    echo: bool = False  # the prompt's text before each answer

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None  # echo lists the prompt's tokens too (vLLM's rule)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [self.prompt]
        if not self.prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(self.prompt)


class TextPart(Body):
    type: str
    text: str = ""


TextParts = TypeAliasType("TextParts", Annotated[list[TextPart], FailFast()])


class ChatMessage(Body):
    role: str
    content: str | TextParts | None = None

    @property
    def num_chars(self) -> int:
        """The characters of its text, which its rendering holds at least."""
        if isinstance(self.content, list):
            return sum(len(part.text) for part in self.content)
        return len(self.content or "")

    def as_template_input(self) -> dict:
        """The message as a chat template reads it: text content only."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, "only text content parts are supported by minillm",
                               param="messages")
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


Messages = TypeAliasType("Messages", Annotated[list[ChatMessage], FailFast()])


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template."""

    messages: Messages
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    add_generation_prompt: bool = True  # vLLM's extension
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: this many top tokens per token

    @property
    def client_names(self) -> dict[str, str]:
        return {**super().client_names, "logprobs": "top_logprobs"}

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(Body):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or ``messages`` rendered by the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_generation_prompt: bool = True  # with messages
    add_special_tokens: bool = True  # with a prompt: what a completion's prompt gets (BOS, ...)
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt")


class DetokenizeRequest(Body):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: TokenIds
