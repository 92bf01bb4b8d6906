"""The OpenAI-compatible HTTP server (chapter: serving over HTTP).

:func:`build_app` puts vLLM's OpenAI endpoints over an ``AsyncEngine``:

- ``GET /health``; ``GET /v1/models``; ``GET /metrics`` (Prometheus text, ``minillm:`` names);
- ``POST /v1/completions``: a prompt as text or token ids, one or a list (one choice each);
- ``POST /v1/chat/completions``: the messages rendered by the tokenizer's chat template.

A handler checks the request first: every client mistake is a 400 (or 404 for an unknown model)
with OpenAI's error body, before anything is queued; every error answer is counted by reason in
``minillm:request_rejected_total`` and logged with its reason. Then it adds one engine request per prompt
and reads their outputs step by step, streamed as server-sent events ending in ``data: [DONE]``
or gathered into one response. When the client hangs up, its requests are aborted before the next
step. :func:`serve` runs it under uvicorn; on SIGTERM or SIGINT it stops taking requests, gives
those in flight ``shutdown_timeout`` seconds to finish, aborts the rest and returns 0.
"""
from __future__ import annotations

import asyncio
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
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minillm.engine.engine import LLMEngine
from minillm.server.async_engine import AsyncEngine, NotAccepting, OutputStream, QueueFull
from minillm.server.detokenizer import Detokenizer
from minillm.server.metrics import CONTENT_TYPE, ServerMetrics
from minillm.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                     GenerationRequest, validation_error)

logger = logging.getLogger("minillm.server")
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
LOG_LIMIT = 4096  # steps and finished requests the served engine's recorder keeps (the latest)


@dataclass
class Call:
    """One HTTP call in the engine: its prompts, the stream of their outputs, their text so far."""

    id: str
    model: str
    prompt_ids: list[list[int]]
    stream: OutputStream
    texts: list[Detokenizer]
    created: int

    async def deltas(self) -> AsyncIterator[tuple[int, str, list[int], str | None]]:
        """(choice index, new text, new token ids, finish reason or None), a step at a time. A stop
        string ends its request here (finish reason "stop"); the engine hears of it next step."""
        index = {request_id: i for i, request_id in enumerate(self.stream.request_ids)}
        async for output in self.stream:
            i = index[output.request_id]
            text = self.texts[i]
            text.add(output.new_token_ids, finished=output.finished)
            finish = output.finish_reason if output.finished else None
            if text.stopped:
                if not output.finished:
                    self.stream.finish(output.request_id, "stop")
                finish = "stop"
            yield i, text.take(finished=finish is not None), output.new_token_ids, finish

    def usage(self) -> dict:
        """Tokens so far: in the last chunk, or in every chunk with continuous_usage_stats."""
        prompt = sum(map(len, self.prompt_ids))
        completion = sum(len(text.token_ids) for text in self.texts)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

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
    """``data: {json}`` per event, an error event if the engine gave up, then ``data: [DONE]``."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
    except (ValueError, NotAccepting) as err:
        status = 400 if isinstance(err, ValueError) else 503
        yield f"data: {json.dumps(APIError(status, str(err)).body())}\n\n"
    yield "data: [DONE]\n\n"


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
    _add_error_handlers(app, async_engine.metrics)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_bearer_check(api_key))])

    @app.get("/health")
    async def health():
        if async_engine.error is not None:
            raise APIError(503, f"the engine stopped after an internal error: {async_engine.error!r}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "minillm",
            "root": model_name, "max_model_len": engine.config.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = engine.now()
        _check(body, model_name)
        prompts = [_prompt_ids(engine, prompt) for prompt in body.prompts()]
        call = await _start(async_engine, model_name, "cmpl", body, prompts, arrival)
        if body.stream:
            return EventStream(_completion_events(call, body), call)
        choices = await _gather(call, request)
        for choice in choices:
            choice["logprobs"] = None
            if not body.return_token_ids:
                del choice["token_ids"]
        return call.chunk("text_completion", choices, usage=call.usage())

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = engine.now()
        _check(body, model_name)
        prompt = _prompt_ids(engine, _chat_prompt(engine, body))
        call = await _start(async_engine, model_name, "chatcmpl", body, [prompt], arrival)
        if body.stream:
            return EventStream(_chat_events(call, body), call)
        choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                    "logprobs": None, "finish_reason": c["finish_reason"],
                    **({"token_ids": c["token_ids"]} if body.return_token_ids else {})}
                   for c in await _gather(call, request)]
        return call.chunk("chat.completion", choices, usage=call.usage())

    app.include_router(v1)
    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error as OpenAI's body; a client's mistake never as a 500 or a traceback. Each one is
    counted by reason (``minillm:request_rejected_total``) and logged with it, but for a client
    that hung up (499), which nobody reads."""

    def reply(request: Request, err: APIError) -> JSONResponse:
        if err.status != 499:
            metrics.reject(err.reason)
            logger.warning("rejected %s %s: %d %s%s: %s", request.method, request.url.path,
                           err.status, err.reason, f" ({err.param})" if err.param else "", err.message)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return reply(request, err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, err: RequestValidationError):
        return reply(request, validation_error(list(err.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):  # unknown path, wrong method
        return reply(request, APIError(err.status_code, str(err.detail), headers=err.headers))

    @app.exception_handler(Exception)
    async def server_error(request, err: Exception):  # a bug of ours: logged with its traceback
        logger.error("internal error on %s", request.url.path, exc_info=err)
        return reply(request, APIError(500, f"internal server error: {err!r}"))


def _bearer_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header "
                                "'Authorization: Bearer <key>' with the server's --api-key")
    return check


# --- checking a request ---------------------------------------------------------------------------

def _check(body: GenerationRequest, model_name: str) -> None:
    body.check_supported()
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"The model `{body.model}` does not exist: this server serves "
                            f"`{model_name}`", param="model", reason="unknown_model")


def _prompt_ids(engine: LLMEngine, prompt: str | list[int]) -> list[int]:
    """Token ids checked against the vocabulary, as the engine checks them (400 if not)."""
    try:
        ids = engine.prompt_token_ids(prompt)
    except ValueError as err:
        raise APIError(400, str(err), param="prompt") from None
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def _chat_prompt(engine: LLMEngine, body: ChatCompletionRequest) -> list[int]:
    """The messages through the model's chat template, as token ids."""
    try:
        return engine.chat_prompt_ids([m.as_template_input() for m in body.messages],
                                      add_generation_prompt=body.add_generation_prompt)
    except ValueError as err:
        raise APIError(400, str(err), param="messages") from None


async def _start(async_engine: AsyncEngine, model_name: str, prefix: str, body: GenerationRequest,
                 prompts: list[list[int]], arrival: float) -> Call:
    """Check lengths, sampling values and the JSON schema, then queue one engine request per prompt."""
    engine = async_engine.engine
    stop = body.stop_strings
    if stop and engine.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer and this model has none: use "
                            "stop_token_ids", param="stop")
    params = [body.sampling_params(_max_tokens(engine.config.max_model_len, len(p),
                                               body.requested_max_tokens(), body.max_tokens_field))
              for p in prompts]
    if any(p.structured_outputs for p in params):
        try:  # a JSON schema compiles off the event loop (the first one also builds the compiler)
            await asyncio.to_thread(lambda: [engine.check_params(p) for p in params])
        except ValueError as err:
            raise APIError(400, str(err), param="response_format") from None
    call_id = f"{prefix}-{uuid.uuid4().hex}"
    request_ids = [f"{call_id}-{i}" for i in range(len(prompts))]
    try:
        stream = async_engine.add(request_ids, prompts, params, arrival)
    except QueueFull as err:
        raise APIError(503, f"the server is busy: {err}; retry in {RETRY_AFTER_S} s",
                       headers={"Retry-After": str(RETRY_AFTER_S)}, reason="queue_full") from None
    except NotAccepting as err:
        raise APIError(503, str(err)) from None
    texts = [Detokenizer(engine.tokenizer, stop, body.min_tokens) for _ in prompts]
    return Call(call_id, model_name, prompts, stream, texts, int(time.time()))


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
    async for index, text, token_ids, finish in call.deltas():
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if body.return_token_ids:
            choice["token_ids"] = token_ids
        yield _with_usage(call, body, call.chunk("text_completion", [choice]))
    if body.include_usage:
        yield call.chunk("text_completion", [], usage=call.usage())


async def _chat_events(call: Call, body: ChatCompletionRequest) -> AsyncIterator[dict]:
    kind = "chat.completion.chunk"
    yield _with_usage(call, body, call.chunk(kind, [{
        "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
        "finish_reason": None}]))
    async for index, text, token_ids, finish in call.deltas():
        choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        if body.return_token_ids:
            choice["token_ids"] = token_ids
        yield _with_usage(call, body, call.chunk(kind, [choice]))
    if body.include_usage:
        yield call.chunk(kind, [], usage=call.usage())


def _with_usage(call: Call, body: GenerationRequest, chunk: dict) -> dict:
    """With continuous_usage_stats, every chunk carries the usage so far (vLLM's extension)."""
    if body.continuous_usage:
        chunk["usage"] = call.usage()
    return chunk


async def _gather(call: Call, request: Request) -> list[dict]:
    """Every choice's text, token ids and finish reason, once all are finished. If the client
    hangs up first, its requests are aborted and the (undeliverable) answer is a 499."""

    async def collect() -> list[dict]:
        choices = [{"index": i, "text": "", "token_ids": [], "finish_reason": None}
                   for i in range(len(call.prompt_ids))]
        async for index, text, token_ids, finish in call.deltas():
            choice = choices[index]
            choice["text"] += text
            choice["token_ids"] += token_ids
            choice["finish_reason"] = finish
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
    except ValueError as err:  # the engine refused a prompt the handler let through
        raise APIError(400, str(err), param="prompt") from None
    except NotAccepting as err:
        raise APIError(503, str(err)) from None


# --- serving ---------------------------------------------------------------------------------------

def serve(model, *, host: str, port: int, max_queue: int | None, shutdown_timeout: float,
          served_model_name: str | None = None, api_key: str | None = None, access_log: bool = False,
          device=None, dtype=None, weights: str = "auto", **engine_args) -> int:
    """Load ``model`` into an ``LLMEngine`` (``engine_args`` are ``EngineConfig``'s), serve it on
    ``host:port`` until SIGTERM or SIGINT, shut down gracefully and return 0."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    engine = LLMEngine(model, device=device, dtype=dtype, weights=weights, log_limit=LOG_LIMIT,
                       **engine_args)
    try:
        _serve_engine(engine, model, host, port, max_queue, shutdown_timeout, served_model_name,
                      api_key, access_log)
    finally:
        engine.close()  # a tensor-parallel engine's ranks end with the server
    return 0


def _serve_engine(engine: LLMEngine, model, host: str, port: int, max_queue: int | None,
                  shutdown_timeout: float, served_model_name: str | None, api_key: str | None,
                  access_log: bool) -> None:
    """Serve ``engine`` with uvicorn until a signal, then drain it."""
    name = served_model_name or str(model)
    async_engine = AsyncEngine(engine, name, max_queue)
    app = build_app(async_engine, name, api_key)
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


async def _serve_until_signal(server: uvicorn.Server, async_engine: AsyncEngine,
                              shutdown_timeout: float) -> None:
    """Run uvicorn; once a signal asks it to exit, drain the engine while uvicorn closes."""
    serving = asyncio.ensure_future(server.serve())
    while not server.should_exit and not serving.done():
        await asyncio.sleep(0.1)
    if not serving.done():
        logger.info("shutting down: no new requests; those in flight get %.0f s to finish",
                    shutdown_timeout)
        finished, aborted = await async_engine.drain(shutdown_timeout)
        logger.info("shutdown: %d requests finished in flight, %d aborted", finished, aborted)
    await serving
