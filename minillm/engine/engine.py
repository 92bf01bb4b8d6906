"""The engine: requests in, tokens out (chapters 一次请求的一生 and 调度).

``LLMEngine`` owns the model, the paged KV cache, the scheduler, the model runner and the recorder.
Each :meth:`LLMEngine.step` is three calls: the scheduler decides which tokens to compute, the
runner computes them and samples, the scheduler moves the requests along; the recorder writes
down what happened. ``minillm.engine.llm.LLM`` is the offline front door.
"""
from __future__ import annotations

import logging
import numbers
import time

import torch

from minillm.engine.config import ModelConfig, load_config, tensor_parallel_shard
from minillm.engine.device import pick_device, resolve_device
from minillm.engine.engine_config import EngineConfig, cpu_kvcache_bytes
from minillm.engine.kv_cache import kv_bytes_per_token, kv_storage_dtype
from minillm.engine.loader import load_model
from minillm.engine.model import Transformer
from minillm.engine.model_runner import ModelRunner
from minillm.engine.paged_cache import PagedKVCache
from minillm.engine.parallel import TensorParallel
from minillm.engine.planner import plan
from minillm.engine.recorder import Recorder
from minillm.engine.request import Request, RequestOutput
from minillm.engine.sampling import SamplingParams
from minillm.engine.scheduler import SCHEDULERS
from minillm.engine.units import fmt_bytes
from minillm.engine.workers import Workers

logger = logging.getLogger("minillm.engine")
if not logger.handlers:  # as vLLM does: the engine's INFO lines on stderr unless the application set its own
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class LLMEngine:
    """add_request / step / abort: the serving loop one step at a time.

    ``model``: a loaded ``Transformer``, or a folder / preset / hub id for ``load_model`` (with
    ``device``, ``dtype``, ``weights``). The other keyword arguments are ``EngineConfig``'s, checked
    before anything is loaded. ``num_kv_blocks=None``: ``minillm.engine.planner.plan`` sizes the
    pool; on the CPU without ``memory_limit``, ``$MINILLM_CPU_KVCACHE_SPACE`` GiB (default 4) does,
    as in vLLM's CPU backend, and the log says so. ``max_model_len=None``: the plan's, else as long as
    the model's positions and the pool allow. ``log_limit``: the most recent steps and finished
    requests the recorder keeps (None: all; a server keeps a bounded tail).

    ``tensor_parallel_size=N`` > 1: this process is rank 0 and starts ranks 1..N-1
    (``minillm.engine.workers``); the sizes below (``model.config``, the plan, the KV pool) are then
    one rank's. :meth:`close` (or leaving a ``with`` block) stops them.
    """

    def __init__(self, model, device=None, dtype=None, weights: str = "auto",
                 log_limit: int | None = None, **engine_args):
        config = EngineConfig(**engine_args)
        _check_device(config, device)
        cpu_kv_bytes = _cpu_kv_bytes(config, model, device)
        self.workers = _start_workers(model, device, dtype, weights, config)
        try:
            self._build(model, device, dtype, weights, config, cpu_kv_bytes)
        except BaseException:
            self.close()
            raise
        self.recorder = Recorder(log_limit, self.scheduler.num_speculative_tokens)
        self._t0 = time.perf_counter()
        self._next_id = 0
        self._aborted: list[RequestOutput] = []  # reported by the next step()

    def _build(self, model, device, dtype, weights, config: EngineConfig, cpu_kv_bytes: int | None) -> None:
        """The model (this rank's shard), the plan (or the CPU's pool of ``cpu_kv_bytes``), the KV
        pool, the scheduler and the runner."""
        workers = self.workers
        if workers:
            device = workers.device  # rank 0's, as _start_workers settled it
        self.model = _load(model, device, dtype, weights, config, workers.tp if workers else TensorParallel())
        if workers:
            workers.wait_loaded()
        if config.speculative_config is not None:  # before the pool is planned or allocated
            config.speculative_config.check_model(self.model.config.num_layers)
        self.tokenizer = getattr(self.model, "tokenizer", None)
        planned = config.num_kv_blocks is None and cpu_kv_bytes is None
        if planned and workers:
            workers.order("plan", config)  # every rank runs the profile step, in step with rank 0
        self.memory_plan = plan(self.model, engine_config=config) if planned else None
        model_config, kv_dtype = self.model.config, kv_storage_dtype(config.kv_cache_dtype, self.model.dtype)
        bytes_per_block = config.block_size * kv_bytes_per_token(model_config, kv_dtype)
        self.config = config = config.resolved(model_config.max_position_embeddings, bytes_per_block,
                                               self.memory_plan, cpu_kv_bytes)
        if cpu_kv_bytes is not None:
            logger.info("KV cache on the CPU: %d blocks of %d tokens (%s) out of $MINILLM_CPU_KVCACHE_SPACE="
                        "%s, at most max_num_seqs=%d requests of max_model_len=%d; num_kv_blocks or "
                        "memory_limit sizes it", config.num_kv_blocks, config.block_size,
                        fmt_bytes(config.num_kv_blocks * bytes_per_block), fmt_bytes(cpu_kv_bytes),
                        config.max_num_seqs, config.max_model_len)
        self.kv_cache = PagedKVCache.from_config(model_config, config, kv_dtype, self.model.device)
        if workers:
            workers.order("cache", config, kv_dtype)
        self.scheduler = SCHEDULERS[config.scheduling](self.kv_cache, config, model_config.eos_token_ids)
        self.runner = ModelRunner(self.model, self.kv_cache, self.config, workers)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (also done at exit); the engine cannot step after."""
        if getattr(self, "workers", None) is not None:
            self.workers.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def now(self) -> float:
        """The engine's clock: seconds since the engine was built."""
        return time.perf_counter() - self._t0

    # -- requests in -----------------------------------------------------------------------------
    def add_request(self, request_id, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_of=None) -> None:
        """Queue a prompt (text, or token ids). ``arrival_time`` is on the engine clock
        (:meth:`now`); default now. ``prompt_of``: an unfinished request with the same prompt whose
        prompt KV blocks this one shares (another answer to it, ``n`` > 1). Invalid requests raise
        ``ValueError`` and change nothing."""
        arrival = self.now() if arrival_time is None else arrival_time
        params = SamplingParams() if params is None else params
        self.check_params(params)
        token_ids = self.prompt_token_ids(prompt)
        if prompt_of is not None:
            parent = self.scheduler.requests.get(str(prompt_of))
            if parent is None or parent.prompt_token_ids != token_ids:
                raise ValueError(f"prompt_of={prompt_of!r} must name an unfinished request with the same prompt")
            prompt_of = parent.request_id
        request = Request(str(request_id), token_ids, params, arrival_time=arrival,
                          tokenizer=self.tokenizer, prompt_of=prompt_of)
        request.metrics.tokenized_time = self.now()
        self.scheduler.add_request(request)  # admission: refused here, nothing is made for it
        if params.structured_outputs is not None:  # compiled by check_params: nothing left to refuse
            self.runner.structured.add(request.request_id, params.structured_outputs)
        self.runner.add_generator(request.request_id, params.seed)

    def check_params(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone, against this model: ``ValueError`` (its
        message starts with the field's name) for stop strings without a tokenizer or a
        ``logit_bias`` token outside the vocabulary; structured outputs under speculative decoding,
        or with a schema the grammar compiler refuses (compiled here, and cached for the request).
        Any thread may call it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer and this model has none: use stop_token_ids")
        vocab = self.model.config.vocab_size
        outside = [t for t in params.logit_bias if t >= vocab]
        if outside:
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab}), got {outside[:5]}")
        if params.structured_outputs is None:
            return
        if self.config.speculative_config is not None:
            raise ValueError("structured_outputs cannot be combined with speculative decoding "
                             "(speculative_config): proposed tokens are not checked against the grammar")
        try:
            self.runner.structured.compile(params.structured_outputs)
        except ValueError as err:
            raise ValueError(f"structured_outputs: {err}") from None

    def prompt_token_ids(self, prompt) -> list[int]:
        """A prompt (text, or token ids) as token ids checked against the vocabulary;
        ``ValueError`` if they are not. Reads only the model, so any thread may call it."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompt token ids must be ints, got {ids[:5]}...")
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.model.config.vocab_size}), "
                             f"got {bad[:5]}")
        return [int(t) for t in ids]

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """A conversation (``[{"role": "user", "content": "..."}, ...]``) rendered by the model's
        chat template, as token ids (the template writes its own special tokens); ``ValueError``
        when the model has no template or the template refuses the messages."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            what = "no tokenizer" if self.tokenizer is None else "a tokenizer without a chat template"
            raise ValueError(f"this model has {what}, so no chat template to render messages with: "
                             f"send a plain prompt, or load a model whose tokenizer has one")
        if not messages:
            raise ValueError("messages must not be empty")
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except (TemplateError, ValueError, TypeError) as err:
            raise ValueError(f"the chat template refused the messages: {err}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def next_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def abort(self, request_id) -> None:
        """Stop a request now (finish reason "abort"); its final output comes with the next step."""
        request = self.scheduler.abort(str(request_id))
        self._retire(request, self.now())
        self._aborted.append(RequestOutput(request, []))

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample once; return an output for every request that got new tokens
        or finished."""
        outputs, self._aborted = self._aborted, []
        if not self.scheduler.has_unfinished():
            return outputs
        start, free_before = self.now(), self.kv_cache.manager.num_free_blocks
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            raise RuntimeError("the scheduler made no progress although requests are unfinished")
        try:
            sampled = self.runner.execute(scheduled)
        except Exception as err:
            if self.workers is None:
                raise
            raise self.workers.failed(err) from err
        finished = self.scheduler.update(scheduled, sampled, self.runner.logprobs, self.runner.prompt_logprobs)
        end = self.now()
        self.recorder.record_step(scheduled, sampled, start, end, free_before,
                                  self.kv_cache.manager.num_free_blocks)
        for request in finished:
            self._retire(request, end)
        return outputs + [RequestOutput(r, sampled[r.request_id]) for r, _ in scheduled.scheduled
                          if r.request_id in sampled]

    def _retire(self, request: Request, when: float) -> None:
        self.recorder.record_finish(request, when)
        self.runner.drop_generator(request.request_id)
        self.runner.structured.drop(request.request_id)

    # -- what happened -----------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        """Start a new run of :meth:`stats` (the pool, the prefix cache and :meth:`snapshot`'s
        counters stay as they are)."""
        self.recorder.reset()

    def snapshot(self) -> dict:
        """How the engine stands now (requests running and waiting, the KV pool) and its counters
        since it was built (``minillm.engine.recorder.COUNTERS``). Reading it changes nothing: the
        server's ``/metrics`` and the run record read the same numbers."""
        kv = self.kv_cache.manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_kv_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "num_free_blocks": kv.num_free_blocks,
            "num_cached_blocks": kv.num_cached_blocks,
            "num_used_blocks": kv.num_used_blocks,
            "kv_usage": kv.num_used_blocks / kv.num_blocks,  # share of the blocks held
            "kv_utilization": kv.utilization(),  # live tokens / slots of the held blocks
            **self.recorder.totals,
        }

    def stats(self) -> dict:
        """:meth:`snapshot` with this run's counters (since :meth:`reset_metrics`) in place of the
        totals, and the run's step log."""
        return {**self.snapshot(), **self.recorder.counters(), "steps": list(self.recorder.steps)}


FP8_MIN_CAPABILITY = (8, 9)  # e4m3 in Triton (fp8e4nv): Ada and Hopper on, not Ampere


def _check_device(config: EngineConfig, device) -> None:
    """An fp8 KV cache on a GPU needs e4m3 support in Triton; refused before anything is loaded."""
    if config.kv_cache_dtype != "fp8":
        return
    device = torch.device(device) if device is not None else pick_device()
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer (Ada, "
                         f"Hopper): {torch.cuda.get_device_name(device)} is "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}; use 'auto'")


def _cpu_kv_bytes(config: EngineConfig, model, device) -> int | None:
    """The CPU's KV pool in bytes (``cpu_kvcache_bytes``) when nothing else sizes it: no
    ``num_kv_blocks``, no ``memory_limit``, the model on the CPU; None otherwise."""
    if config.num_kv_blocks is not None or config.memory_limit is not None:
        return None
    where = model.device if isinstance(model, Transformer) else resolve_device(device)
    return cpu_kvcache_bytes() if where.type == "cpu" else None


def _start_workers(model, device, dtype, weights, config: EngineConfig) -> Workers | None:
    """Ranks 1..N-1 of a tensor-parallel engine, started once the model's shape and the devices
    are checked (nothing is loaded before); None for one rank."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    if isinstance(model, Transformer):
        raise ValueError(f"tensor_parallel_size={size} needs the model as a folder, preset, hub id or "
                         f"ModelConfig, not a loaded Transformer: each rank loads its own shard")
    tensor_parallel_shard(model if isinstance(model, ModelConfig) else load_config(model), size)  # checks
    device = resolve_device(device)
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(f"tensor_parallel_size={size} runs on cuda:0..cuda:{size - 1}; got device={device}")
        if size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
        device = torch.device("cuda", 0)
    return Workers(model, device, dtype, weights, size)


def _load(model, device, dtype, weights, config: EngineConfig, tp: TensorParallel) -> Transformer:
    """An already built Transformer as is, or load one (path, preset or hub id), quantized as the
    settings say; under tensor parallelism, this rank's shard."""
    if isinstance(model, Transformer):
        if device is not None and torch.device(device).type != model.device.type:
            raise ValueError(f"device={device} but the given model is on {model.device}")
        if dtype is not None and dtype != model.dtype:
            raise ValueError(f"dtype={dtype} but the given model is {model.dtype}")
        if config.quantization is not None and model.quantization != (config.quantization, config.group_size):
            raise ValueError(f"quantization={config.quantization!r} asked for, but the given model is "
                             f"{'not quantized' if model.quantization is None else model.quantization}: "
                             f"load it with load_model(..., quantization=...)")
        return model
    return load_model(model, device=device, dtype=dtype, weights=weights,
                      quantization=config.quantization, group_size=config.group_size, tensor_parallel=tp)
