"""The OpenAI-compatible HTTP server (chapter: serving over HTTP).

:func:`build_app` puts vLLM's OpenAI endpoints over an ``AsyncEngine``:

- ``GET /health`` (503 once the engine loop has stopped); ``GET /v1/models``; ``GET /metrics``
  (Prometheus text, ``minillm:`` names); ``GET /version``;
- ``POST /v1/completions``: a prompt as text or token ids, one or a list (``n`` choices each);
- ``POST /v1/chat/completions``: the messages rendered by the tokenizer's chat template;
- ``POST /tokenize``, ``POST /detokenize``: vLLM's, the tokenizer alone.

Stop strings, penalties, ``logit_bias``, ``min_p`` and logprobs are the engine's
(``SamplingParams``); ``n`` answers to a prompt are ``n`` engine requests, the later ones made
``prompt_of`` the first, so its prompt's KV blocks are computed once and shared. Logprobs come in
OpenAI's two shapes: the legacy one for completions, per-token objects for chat. A completion with
``echo`` and ``logprobs`` lists the prompt's tokens first (the engine's prompt logprobs, null for the
first token), then the generated ones.

A body over :data:`MAX_BODY_BYTES` is a 413 before it is parsed. A handler checks the request
first: every client mistake is a 400 (or 404 for an unknown model) with OpenAI's error body,
before anything is queued. The body is parsed and its types checked in a thread, not on the event
loop where FastAPI would do it (8 MiB of tiny JSON items take seconds). Text longer than
``max_model_len`` tokens could hold (no token of the vocabulary covers more characters than its
longest) is refused before it is tokenized, and tokenizing runs in a thread of its own, so
``/health`` and the streams keep answering while a long prompt is tokenized. Every error answer is counted by reason in
``minillm:request_rejected_total`` and logged with its reason. Then it adds one engine request per prompt
and reads their outputs step by step, streamed as server-sent events ending in ``data: [DONE]``
or gathered into one response. When the client hangs up, its requests are aborted before the next
step. :func:`serve` runs it under uvicorn; on SIGTERM or SIGINT it stops taking requests, gives
those in flight ``shutdown_timeout`` seconds to finish, aborts the rest and returns 0. If the
engine loop stops on an error, the server shuts down by itself and returns 1.
"""
from __future__ import annotations

import asyncio
import dataclasses
import email.message
import gc
import json
import logging
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

import minillm
from minillm.engine.engine import LLMEngine
from minillm.engine.sampling import TokenLogprob
from minillm.server.async_engine import AsyncEngine, NotAccepting, OutputStream, QueueFull
from minillm.server.metrics import CONTENT_TYPE, ServerMetrics
from minillm.server.protocol import (APIError, Body, ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, GenerationRequest, TokenizeRequest,
                                     client_fields, validation_error)

logger = logging.getLogger("minillm.server")
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
LOG_LIMIT = 4096  # steps and finished requests the served engine's recorder keeps (the latest)
MAX_BODY_BYTES = 8 * 2**20  # a larger request body is a 413


@dataclass
class Delta:
    """What one step added to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None  # with echo, the prompt's first (None: its first token)
    finish_reason: str | None


@dataclass
class Call:
    """One HTTP call in the engine: its prompts, ``n`` choices each (choice ``i * n + j`` is the
    j-th answer to prompt i), the stream of their outputs."""

    id: str
    model: str
    prompt_ids: list[list[int]]
    stream: OutputStream
    created: int
    tokenizer: object
    echo: list[str]  # per choice, the text before its answer (the prompt's, with echo)

    def __post_init__(self):
        self.num_tokens = [0] * len(self.echo)  # generated so far, per choice
        self.offsets = [0] * len(self.echo)  # where each choice's next listed token's text starts
        self._echoed: set[int] = set()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's new text, token ids and logprobs, a step at a time (its echo first, and the
        prompt's logprobs before the first token's when it asked for them); its finish reason once
        finished."""
        index = {request_id: i for i, request_id in enumerate(self.stream.request_ids)}
        async for output in self.stream:
            i = index[output.request_id]
            echo, logprobs = "", output.new_logprobs
            if i not in self._echoed:
                self._echoed.add(i)
                echo = self.echo[i]
                if output.prompt_logprobs is not None:
                    logprobs = output.prompt_logprobs + logprobs
            self.num_tokens[i] += len(output.new_token_ids)
            yield Delta(i, echo + (output.new_text or ""), output.new_token_ids, logprobs,
                        output.finish_reason if output.finished else None)

    def usage(self) -> dict:
        """Tokens so far: in the last chunk, or in every chunk with continuous_usage_stats (a prompt
        counts once, whatever its ``n``)."""
        prompt = sum(map(len, self.prompt_ids))
        completion = sum(self.num_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def token_text(self, token_id: int) -> str:
        """A token as text on its own (vLLM's ``token_id:N`` without a tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, index: int, logprobs: list[TokenLogprob | None] | None) -> dict | None:
        """The legacy completions shape: tokens, their logprobs, the top ones (the token's own
        among them) and each token's offset in the choice's text; null logprobs for the prompt's
        first token (None: nothing scores it)."""
        if logprobs is None:
            return None
        prompt = self.prompt_ids[index * len(self.prompt_ids) // len(self.echo)]  # choice i * n + j: prompt i
        tokens = [self.token_text(prompt[0] if lp is None else lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(token)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
                "top_logprobs": [None if lp is None else {**{self.token_text(t): v for t, v in lp.top},
                                                          token: lp.logprob}
                                 for token, lp in zip(tokens, logprobs, strict=True)],
                "text_offset": offsets}

    def chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        """The chat shape: one object per token, with its UTF-8 bytes and its top tokens."""
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(*top) for top in lp.top]}
                            for lp in logprobs]}

    def chunk(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}


class EventStream(StreamingResponse):
    """Server-sent events whose requests are aborted when the response ends, however it ends
    (sent to the last event, the client hung up, the server shut down): no request outlives its
    connection, even one whose events never started."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[dict], call: Call):
        super().__init__(_sse(events))
        self.call = call

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.stream.abort()


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """``data: {json}`` per event, an error event if the engine refused or gave up, then
    ``data: [DONE]``."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
    except Exception as err:
        status = 400 if isinstance(err, ValueError) else 503 if isinstance(err, NotAccepting) else 500
        if status == 500:
            logger.error("internal error in a stream", exc_info=err)
        yield f"data: {json.dumps(APIError(status, str(err)).body())}\n\n"
    yield "data: [DONE]\n\n"


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413 (declared or as it arrives),
    answered before the app sees it; ``reply`` writes the error answer."""

    def __init__(self, app, limit: int, reply):
        self.app, self.limit, self.reply = app, limit, reply

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        chunks, size = [], 0
        while declared is None or int(declared) <= self.limit:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                break
            if not message.get("more_body"):
                return await self.app(scope, _replay(b"".join(chunks), receive), send)
        err = APIError(413, f"the request body is larger than {self.limit // 2**20} MiB",
                       reason="body_too_large")
        await self.reply(scope, err)(scope, receive, send)


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that hands over ``body`` first, then whatever ``receive`` gets."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay


# --- the app ------------------------------------------------------------------------------------

def build_app(async_engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``async_engine`` as ``model_name``; ``api_key``: the bearer token
    ``/v1`` routes require (None: open). The app starts and stops the engine loop itself."""
    engine = async_engine.engine

    @asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        yield
        await async_engine.stop()

    app = FastAPI(title="minillm", lifespan=lifespan)
    reply = _add_error_handlers(app, async_engine.metrics)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES,
                       reply=lambda scope, err: reply(scope["method"], scope["path"], err))
    auth = [Depends(_bearer_check(api_key))]
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    longest = _longest_token(engine.tokenizer)

    @app.get("/health")
    async def health():
        if async_engine.error is not None:
            raise APIError(503, f"the engine stopped after an internal error: {async_engine.error!r}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": minillm.__version__}

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest = _parsed(TokenizeRequest)):
        body.check()
        _check_model(body.model, model_name)
        if body.messages is not None:
            _check_chars(sum(m.num_chars for m in body.messages), longest, engine, "messages")
            ids = await async_engine.tokenize(_chat_prompt, engine, body)
        else:
            _check_chars(len(body.prompt), longest, engine, "prompt")
            ids = await async_engine.tokenize(_text_ids, engine, body.prompt, body.add_special_tokens)
        to_strs = engine.tokenizer.convert_ids_to_tokens if body.return_token_strs else lambda ids: None
        return await async_engine.tokenize(lambda: JSONResponse({  # millions of ids: off the loop too
            "count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids,
            "token_strs": to_strs(ids)}))

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest = _parsed(DetokenizeRequest)):
        _check_model(body.model, model_name)
        tokenizer = _tokenizer(engine, "tokens")
        return await async_engine.tokenize(lambda: JSONResponse({"prompt": tokenizer.decode(
            _prompt_ids(engine, body.tokens, "tokens", allow_empty=True))}))

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "minillm",
            "root": model_name, "max_model_len": engine.config.max_model_len}]}

    @v1.post("/completions")
    async def completions(request: Request, body: CompletionRequest = _parsed(CompletionRequest)):
        arrival = engine.now()
        _check(body, model_name)
        texts = body.prompts()
        _check_count(async_engine, len(texts) * body.n)
        for prompt in texts:
            if isinstance(prompt, str):
                _check_chars(len(prompt), longest, engine, "prompt")
        prompts = await async_engine.tokenize(lambda: [_prompt_ids(engine, p) for p in texts])
        echo = [_echo_text(engine, text, ids) if body.echo else "" for text, ids in zip(texts, prompts)]
        call = await _start(async_engine, model_name, "cmpl", body, prompts, arrival, echo)
        if body.stream:
            return EventStream(_completion_events(call, body), call)
        choices = [{"index": c["index"], "text": c["text"],
                    "logprobs": call.completion_logprobs(c["index"], c["logprobs"]),
                    "finish_reason": c["finish_reason"],
                    **({"token_ids": c["token_ids"]} if body.return_token_ids else {})}
                   for c in await _gather(call, request)]
        return call.chunk("text_completion", choices, usage=call.usage())

    @v1.post("/chat/completions")
    async def chat_completions(request: Request,
                               body: ChatCompletionRequest = _parsed(ChatCompletionRequest)):
        arrival = engine.now()
        _check(body, model_name)
        _check_chars(sum(m.num_chars for m in body.messages), longest, engine, "messages")
        prompt = _prompt_ids(engine, await async_engine.tokenize(_chat_prompt, engine, body))
        call = await _start(async_engine, model_name, "chatcmpl", body, [prompt], arrival)
        if body.stream:
            return EventStream(_chat_events(call, body), call)
        choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                    "logprobs": call.chat_logprobs(c["logprobs"]), "finish_reason": c["finish_reason"],
                    **({"token_ids": c["token_ids"]} if body.return_token_ids else {})}
                   for c in await _gather(call, request)]
        return call.chunk("chat.completion", choices, usage=call.usage())

    app.include_router(v1)
    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics):
    """Every error as OpenAI's body; a client's mistake never as a 500 or a traceback. Each one is
    counted by reason (``minillm:request_rejected_total``) and logged with it, but for a client
    that hung up (499), which nobody reads. Returns ``reply(method, path, err)``, the answer."""

    def reply(method: str, path: str, err: APIError) -> JSONResponse:
        if err.status != 499:
            metrics.reject(err.reason)
            logger.warning("rejected %s %s: %d %s%s: %s", method, path, err.status, err.reason,
                           f" ({err.param})" if err.param else "", err.message)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return reply(request.method, request.url.path, err)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):  # unknown path, wrong method
        return reply(request.method, request.url.path,
                     APIError(err.status_code, str(err.detail), headers=err.headers))

    @app.exception_handler(Exception)
    async def server_error(request, err: Exception):  # a bug of ours: logged with its traceback
        logger.error("internal error on %s", request.url.path, exc_info=err)
        return reply(request.method, request.url.path, APIError(500, f"internal server error: {err!r}"))

    return reply


def _bearer_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header "
                                "'Authorization: Bearer <key>' with the server's key (its "
                                "--api-key, or MINILLM_API_KEY)")
    return check


# --- checking a request ---------------------------------------------------------------------------

def _parsed(model: type[Body]):
    """The request body as ``model`` (a dependency): read, then parsed and type-checked in a
    thread, so that the event loop serves /health and the streams meanwhile; a 400 naming what
    is wrong."""
    async def parse(request: Request) -> Body:
        raw = await request.body()
        return await asyncio.to_thread(_parse_body, model, raw, request.headers.get("content-type"))
    return Depends(parse)


def _parse_body(model: type[Body], raw: bytes, content_type: str | None) -> Body:
    """``raw`` as ``model``, read as FastAPI reads a body: as JSON only when sent as JSON
    (``application/json`` or ``+json``), otherwise as bytes, which no model takes."""
    if not raw:
        raise APIError(400, "body: Field required", param="body")
    kind = email.message.Message()
    kind["content-type"] = content_type or "application/octet-stream"
    sent_as_json = kind.get_content_maintype() == "application" and (
        kind.get_content_subtype() == "json" or kind.get_content_subtype().endswith("+json"))
    try:
        data = json.loads(raw) if sent_as_json else raw
    except ValueError:  # not JSON, or not UTF-8
        raise APIError(400, "the request body is not valid JSON") from None
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None


def _check(body: GenerationRequest, model_name: str) -> None:
    body.check_supported()
    _check_model(body.model, model_name)


def _check_model(model: str | None, model_name: str) -> None:
    if model is not None and model != model_name:
        raise APIError(404, f"The model `{model}` does not exist: this server serves "
                            f"`{model_name}`", param="model", reason="unknown_model")


def _check_count(async_engine: AsyncEngine, num_prompts: int) -> None:
    """A list of prompts longer than the queue can never be taken: a 400, not a 503 to retry."""
    if async_engine.max_queue is not None and num_prompts > async_engine.max_queue:
        raise APIError(400, f"{num_prompts} prompts in one request, more than the server's queue "
                            f"holds (max_queue={async_engine.max_queue}): send them in smaller "
                            f"lists", param="prompt")


def _longest_token(tokenizer) -> int | None:
    """The most characters one token of the vocabulary covers (its longest entry: a byte-level
    entry has a character per byte), or None without a tokenizer."""
    return None if tokenizer is None else max(map(len, tokenizer.get_vocab()))


def _check_chars(num_chars: int, longest: int | None, engine: LLMEngine, param: str) -> None:
    """400 for text that cannot fit ``max_model_len`` tokens, before it is tokenized: no token
    covers more than ``longest`` characters, so it needs more than ``max_model_len`` tokens."""
    max_model_len = engine.config.max_model_len
    if longest is not None and num_chars > longest * max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, {param} has {num_chars} characters, more than "
                            f"{max_model_len} tokens can hold (no token of this model covers more "
                            f"than {longest})", param=param, reason="context_length")


def _tokenizer(engine: LLMEngine, param: str):
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send token ids", param=param)
    return engine.tokenizer


def _text_ids(engine: LLMEngine, text: str, add_special_tokens: bool) -> list[int]:
    """``text`` as token ids, with the special tokens a prompt gets or without them."""
    if add_special_tokens:
        return _prompt_ids(engine, text, allow_empty=True)
    return list(_tokenizer(engine, "prompt").encode(text, add_special_tokens=False))


def _prompt_ids(engine: LLMEngine, prompt: str | list[int], param: str = "prompt",
                allow_empty: bool = False) -> list[int]:
    """Token ids checked against the vocabulary, as the engine checks them (400 if not)."""
    try:
        ids = engine.prompt_token_ids(prompt)
    except ValueError as err:
        raise APIError(400, str(err), param=param) from None
    if not ids and not allow_empty:
        raise APIError(400, "the prompt is empty", param=param)
    return ids


def _chat_prompt(engine: LLMEngine, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """The messages through the model's chat template, as token ids."""
    try:
        return engine.chat_prompt_ids([m.as_template_input() for m in body.messages],
                                      add_generation_prompt=body.add_generation_prompt)
    except ValueError as err:
        raise APIError(400, str(err), param="messages") from None


def _echo_text(engine: LLMEngine, prompt: str | list[int], ids: list[int]) -> str:
    """The prompt as text, for echo: as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(ids) if engine.tokenizer is not None else ""


async def _start(async_engine: AsyncEngine, model_name: str, prefix: str, body: GenerationRequest,
                 prompts: list[list[int]], arrival: float, echo: list[str] | None = None) -> Call:
    """Check lengths, sampling values and the JSON schema, then queue ``n`` engine requests per
    prompt, the later ones sharing the first one's prompt blocks."""
    engine = async_engine.engine
    n = body.n
    per_prompt = [body.sampling_params(_max_tokens(engine.config.max_model_len, len(p),
                                                   body.requested_max_tokens(), body.max_tokens_field))
                  for p in prompts]
    with client_fields(body.client_names):
        if any(p.structured_outputs for p in per_prompt):  # a JSON schema compiles off the event loop
            await asyncio.to_thread(lambda: [engine.check_params(p) for p in per_prompt])
        else:
            for one in per_prompt:
                engine.check_params(one)
    # n seeded answers must differ: the j-th draws from seed + j (vLLM's rule)
    params = [one if one.seed is None or j == 0 else dataclasses.replace(one, seed=(one.seed + j) % 2**64)
              for one in per_prompt for j in range(n)]
    call_id = f"{prefix}-{uuid.uuid4().hex}"
    request_ids = [f"{call_id}-{i}" for i in range(len(prompts) * n)]
    prompt_of = [None if i % n == 0 else request_ids[i - i % n] for i in range(len(request_ids))]
    try:
        stream = async_engine.add(request_ids, [p for p in prompts for _ in range(n)], params, arrival,
                                  prompt_of)
    except QueueFull as err:
        raise APIError(503, f"the server is busy: {err}; retry in {RETRY_AFTER_S} s",
                       headers={"Retry-After": str(RETRY_AFTER_S)}, reason="queue_full") from None
    except NotAccepting as err:
        raise APIError(503, str(err)) from None
    echo = echo or [""] * len(prompts)
    return Call(call_id, model_name, prompts, stream, int(time.time()), engine.tokenizer,
                [e for e in echo for _ in range(n)])


def _max_tokens(max_model_len: int, num_prompt_tokens: int, requested: int | None,
                field: str = "max_tokens") -> int:
    """``requested``, or what is left of ``max_model_len`` when None; 400 when it does not fit
    (vLLM's rule: prompt + max_tokens <= max_model_len). ``field``: the client's name for it."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, your prompt has {num_prompt_tokens} tokens, which leaves no "
                            f"room for a completion", param="prompt", reason="context_length")
    if requested is None:
        return max_model_len - num_prompt_tokens
    if requested >= 1 and num_prompt_tokens + requested > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, you requested {num_prompt_tokens + requested} tokens "
                            f"({num_prompt_tokens} in the prompt, {requested} in the completion): "
                            f"reduce the prompt or {field}", param=field, reason="context_length")
    return requested


# --- answering ------------------------------------------------------------------------------------

async def _completion_events(call: Call, body: CompletionRequest) -> AsyncIterator[dict]:
    async for delta in call.deltas():
        choice = {"index": delta.index, "text": delta.text,
                  "logprobs": call.completion_logprobs(delta.index, delta.logprobs),
                  "finish_reason": delta.finish_reason}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        yield _with_usage(call, body, call.chunk("text_completion", [choice]))
    if body.include_usage:
        yield call.chunk("text_completion", [], usage=call.usage())


async def _chat_events(call: Call, body: ChatCompletionRequest) -> AsyncIterator[dict]:
    kind = "chat.completion.chunk"
    yield _with_usage(call, body, call.chunk(kind, [{
        "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
        "finish_reason": None} for i in range(body.n)]))
    async for delta in call.deltas():
        choice = {"index": delta.index, "delta": {"content": delta.text},
                  "logprobs": call.chat_logprobs(delta.logprobs), "finish_reason": delta.finish_reason}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        yield _with_usage(call, body, call.chunk(kind, [choice]))
    if body.include_usage:
        yield call.chunk(kind, [], usage=call.usage())


def _with_usage(call: Call, body: GenerationRequest, chunk: dict) -> dict:
    """With continuous_usage_stats, every chunk carries the usage so far (vLLM's extension)."""
    if body.continuous_usage:
        chunk["usage"] = call.usage()
    return chunk


async def _gather(call: Call, request: Request) -> list[dict]:
    """Every choice's text, token ids, logprobs (None if not asked for) and finish reason, once all
    are finished. If the client hangs up first, its requests are aborted and the (undeliverable)
    answer is a 499."""

    async def collect() -> list[dict]:
        choices = [{"index": i, "text": "", "token_ids": [], "logprobs": None, "finish_reason": None}
                   for i in range(len(call.echo))]
        async for delta in call.deltas():
            choice = choices[delta.index]
            choice["text"] += delta.text
            choice["token_ids"] += delta.token_ids
            if delta.logprobs is not None:
                choice["logprobs"] = (choice["logprobs"] or []) + delta.logprobs
            choice["finish_reason"] = delta.finish_reason
        return choices

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        answer.cancel()
        gone.cancel()
        call.stream.abort()
    if not answer.done() or answer.cancelled():
        raise APIError(499, "the client closed the connection")
    try:
        return answer.result()
    except ValueError as err:  # the engine refused a request the handler let through
        raise APIError(400, str(err)) from None
    except NotAccepting as err:
        raise APIError(503, str(err)) from None


# --- serving ---------------------------------------------------------------------------------------

def serve(model, *, host: str, port: int, max_queue: int | None, shutdown_timeout: float,
          served_model_name: str | None = None, api_key: str | None = None, access_log: bool = False,
          device=None, dtype=None, weights: str = "auto", **engine_args) -> int:
    """Load ``model`` into an ``LLMEngine`` (``engine_args`` are ``EngineConfig``'s), serve it on
    ``host:port`` until SIGTERM or SIGINT, shut down gracefully and return 0; return 1 once the
    engine loop has stopped on an error (the server shuts itself down then)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    engine = LLMEngine(model, device=device, dtype=dtype, weights=weights, log_limit=LOG_LIMIT,
                       **engine_args)
    try:
        error = _serve_engine(engine, model, host, port, max_queue, shutdown_timeout,
                              served_model_name, api_key, access_log)
    finally:
        engine.close()  # a tensor-parallel engine's ranks end with the server
    return 0 if error is None else 1


def _serve_engine(engine: LLMEngine, model, host: str, port: int, max_queue: int | None,
                  shutdown_timeout: float, served_model_name: str | None, api_key: str | None,
                  access_log: bool) -> Exception | None:
    """Serve ``engine`` with uvicorn until a signal (or until its loop stops), then drain it;
    what stopped the loop, if anything did."""
    name = served_model_name or str(model)
    async_engine = AsyncEngine(engine, name, max_queue)
    app = build_app(async_engine, name, api_key)
    gc.collect()  # what is loaded lives as long as the server: kept out of every later collection,
    gc.freeze()   # which holds the GIL while it walks (vLLM does the same)
    cfg = engine.config
    logger.info("minillm: serving %s on %s (%s): %d KV blocks of %d tokens, max_model_len %d, "
                "max_num_seqs %d, max_queue %s", name, engine.model.device,
                str(engine.model.dtype).removeprefix("torch."), cfg.num_kv_blocks, cfg.block_size,
                cfg.max_model_len, cfg.max_num_seqs, max_queue)
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, access_log=access_log, log_level="info",
        timeout_graceful_shutdown=shutdown_timeout + 5))
    # uvicorn re-raises the signal that stopped it once it has shut down; ignored, a clean stop exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    asyncio.run(_serve_until_signal(server, async_engine, shutdown_timeout))
    return async_engine.error


async def _serve_until_signal(server: uvicorn.Server, async_engine: AsyncEngine,
                              shutdown_timeout: float) -> None:
    """Run uvicorn; once a signal asks it to exit, drain the engine while uvicorn closes. If the
    engine loop stops on an error, ask uvicorn to exit."""
    serving = asyncio.ensure_future(server.serve())
    while not server.should_exit and not serving.done():
        if async_engine.error is not None:
            logger.error("the engine loop stopped (%r): shutting down", async_engine.error)
            server.should_exit = True
        await asyncio.sleep(0.1)
    if not serving.done():
        logger.info("shutting down: no new requests; those in flight get %.0f s to finish",
                    shutdown_timeout)
        finished, aborted = await async_engine.drain(shutdown_timeout)
        logger.info("shutdown: %d requests finished in flight, %d aborted", finished, aborted)
    await serving
