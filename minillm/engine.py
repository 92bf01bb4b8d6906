"""The engine: requests in, tokens out (chapters 一次请求的一生 and 调度).

``LLMEngine`` owns the model, the paged KV cache and the scheduler. Each :meth:`LLMEngine.step`
asks the scheduler which tokens to compute, lets :class:`ModelRunner` run them as one flat batch
through the model, samples the next token of every request whose tokens are all computed, and
stamps the time of each event on the request's metrics. ``LLM`` is the offline front door:
``generate(prompts, params)`` runs a whole list of prompts (optionally replaying their arrival
times) and returns the outputs in input order.
"""
from __future__ import annotations

import json
import numbers
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from minillm.estimate import GiB, kv_bytes_per_token
from minillm.loader import load_model
from minillm.memory import plan
from minillm.metrics import RequestMetrics, summarize
from minillm.model import AttentionMetadata, Transformer
from minillm.paging import KVCacheManager
from minillm.sampling import SamplingParams, make_generator, sample
from minillm.scheduler import (Request, RequestStatus, Scheduler, SchedulerOutput,
                               StaticBatchScheduler, check_scheduler_args)

SCHEDULERS = {"continuous": Scheduler, "static": StaticBatchScheduler}
SWAP_SPACE_BYTES = 4 * GiB  # default CPU pool for swap preemption (vLLM's swap_space default)
METRICS_FORMAT = "minillm-run-metrics"


@dataclass
class RequestOutput:
    """A request's generated tokens so far; ``new_token_ids`` are the ones from the latest step
    (streaming). ``text`` is decoded once the request has finished (when there is a tokenizer)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    metrics: RequestMetrics
    text: str | None = None


class ModelRunner:
    """One step's scheduled tokens -> one forward pass over a flat batch -> sampled tokens."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, num_cpu_blocks: int = 0):
        cfg = model.config
        self.model = model
        self.device = model.device
        # One tensor for all layers: [num_layers, 2 (K, V), num_blocks, block_size, n_kv, d].
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.cpu_cache = (torch.zeros((*shape[:2], num_cpu_blocks, *shape[3:]), dtype=model.dtype,
                                      pin_memory=self.device.type == "cuda")
                          if num_cpu_blocks else None)
        self.generators: dict[str, torch.Generator] = {}  # per-request seeded RNGs

    def add_generator(self, request_id: str, seed: int | None) -> None:
        generator = make_generator(seed, self.device)
        if generator is not None:
            self.generators[request_id] = generator

    def drop_generator(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def swap(self, output: SchedulerOutput) -> None:
        """Copy preempted requests' blocks to the CPU pool, then resumed ones back (swap mode)."""
        if output.blocks_to_swap_out:
            self._copy_blocks(output.blocks_to_swap_out, self.kv_cache, self.cpu_cache)
        if output.blocks_to_swap_in:
            self._copy_blocks(output.blocks_to_swap_in, self.cpu_cache, self.kv_cache)

    @staticmethod
    def _copy_blocks(pairs: list[tuple[int, int]], src: torch.Tensor, dst: torch.Tensor) -> None:
        src_ids = torch.tensor([s for s, _ in pairs], device=src.device)
        dst_ids = torch.tensor([d for _, d in pairs], device=dst.device)
        dst[:, :, dst_ids] = src[:, :, src_ids].to(dst.device)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, kv: KVCacheManager) -> dict[str, int]:
        """Run the scheduled tokens; return request_id -> sampled token for every request whose
        tokens are now all computed (a finished prompt or a decode)."""
        input_ids, positions, slots, cu_seqlens, seq_lens, tables = [], [], [], [0], [], []
        sample_rows, sampled_requests = [], []
        for request, num_new in output.scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            input_ids += request.token_ids(start, end)
            positions += range(start, end)
            slots += kv.slot_mapping(request.request_id, start, end)
            cu_seqlens.append(cu_seqlens[-1] + num_new)
            seq_lens.append(end)
            tables.append(kv.block_table(request.request_id))
            if end == request.num_tokens:
                sample_rows.append(cu_seqlens[-1] - 1)
                sampled_requests.append(request)
        width = max(len(t) for t in tables)
        device = self.device
        attn = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(n for _, n in output.scheduled),
        )
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=device),
                            torch.tensor(positions, dtype=torch.int64, device=device),
                            attn, self.kv_caches)
        if not sampled_requests:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])
        tokens = sample(logits, [r.params for r in sampled_requests],
                        [self.generators.get(r.request_id) for r in sampled_requests])
        return {r.request_id: t for r, t in zip(sampled_requests, tokens.tolist(), strict=True)}


class LLMEngine:
    """add_request / step / abort: the serving loop one step at a time.

    ``model``: a loaded ``Transformer``, or a folder / preset / hub id for ``load_model`` (with
    ``device``, ``dtype``, ``weights``). ``num_kv_blocks=None``: ``minillm.memory.plan`` sizes the
    pool (on the CPU it needs ``memory_limit``). ``max_model_len=None``: the plan's, else as long
    as the model's positions and the pool allow. ``scheduling``: "continuous" or "static" (the
    baseline). ``num_cpu_blocks``: the swap pool for ``preemption_mode="swap"`` (default: as
    large as the GPU pool, at most ``SWAP_SPACE_BYTES``).
    """

    def __init__(self, model, device=None, dtype=None, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 gpu_memory_utilization: float = 0.92, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, preemption_mode: str = "recompute",
                 weights: str = "auto", scheduling: str = "continuous", memory_limit=None,
                 num_cpu_blocks: int | None = None):
        if scheduling not in SCHEDULERS:
            raise ValueError(f"scheduling must be one of {tuple(SCHEDULERS)}, got {scheduling!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_kv_blocks is not None and num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 (or None for the planner), got {num_kv_blocks}")
        if num_cpu_blocks is not None and num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        check_scheduler_args(max_num_seqs, max_num_batched_tokens, preemption_mode)
        self.model = _load(model, device, dtype, weights)
        self.config = self.model.config
        self.tokenizer = getattr(self.model, "tokenizer", None)
        self.memory_plan = None
        if num_kv_blocks is None:
            self.memory_plan = plan(self.model, gpu_memory_utilization=gpu_memory_utilization,
                                    block_size=block_size, max_model_len=max_model_len,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    max_num_seqs=max_num_seqs, memory_limit=memory_limit)
            num_kv_blocks = self.memory_plan.num_blocks
            max_model_len = self.memory_plan.max_model_len
        if max_model_len is None:  # as long as the model and the pool allow
            max_model_len = min(self.config.max_position_embeddings, num_kv_blocks * block_size)
        elif max_model_len > self.config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={self.config.max_position_embeddings}")
        if preemption_mode != "swap":
            num_cpu_blocks = 0
        elif num_cpu_blocks is None:  # the whole GPU pool, at most SWAP_SPACE_BYTES of host memory
            bytes_per_block = block_size * kv_bytes_per_token(self.config, self.model.dtype)
            num_cpu_blocks = min(num_kv_blocks, SWAP_SPACE_BYTES // bytes_per_block)
        self.kv = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.scheduler = SCHEDULERS[scheduling](
            self.kv, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill, preemption_mode=preemption_mode,
            num_cpu_blocks=num_cpu_blocks, eos_token_ids=self.config.eos_token_ids)
        self.runner = ModelRunner(self.model, num_kv_blocks, block_size, num_cpu_blocks)
        self.settings = dict(block_size=block_size, num_kv_blocks=num_kv_blocks,
                             num_cpu_blocks=num_cpu_blocks, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             enable_prefix_caching=enable_prefix_caching,
                             enable_chunked_prefill=enable_chunked_prefill,
                             preemption_mode=preemption_mode, scheduling=scheduling)
        self._t0 = time.perf_counter()
        self._next_id = 0
        self._aborted: list[RequestOutput] = []  # reported by the next step()
        self.reset_metrics()

    def now(self) -> float:
        """The engine's clock: seconds since the engine was built."""
        return time.perf_counter() - self._t0

    def reset_metrics(self) -> None:
        """Start a new run: empty step log and finished-request records, counters at zero."""
        self.step_log: list[dict] = []
        self.finished: list[Request] = []
        self.scheduler.num_preemptions = 0
        self.scheduler.prefix_hit_tokens = 0

    # -- requests in -----------------------------------------------------------------------------
    def add_request(self, request_id, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a prompt (text, or token ids). ``arrival_time`` is on the engine clock
        (:meth:`now`); default now. Invalid requests raise ``ValueError`` and change nothing."""
        arrival = self.now() if arrival_time is None else arrival_time
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request = Request(str(request_id), self._token_ids(prompt), params, arrival_time=arrival)
        request.metrics.tokenized_time = self.now()
        self.scheduler.add_request(request)
        self.runner.add_generator(request.request_id, params.seed)

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompt token ids must be ints, got {ids[:5]}...")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size}), "
                             f"got {bad[:5]}")
        return [int(t) for t in ids]

    def next_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def abort(self, request_id) -> None:
        """Stop a request now; its final output (finish_reason "abort") comes with the next step."""
        request = self.scheduler.abort(str(request_id))
        self._retire(request, self.now())
        self._aborted.append(self._output(request, []))

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample once; return an output for every request that got new tokens
        or finished."""
        outputs, self._aborted = self._aborted, []
        if not self.scheduler.has_unfinished():
            return outputs
        start = self.now()
        free_before = self.kv.num_free_blocks
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            raise RuntimeError("the scheduler made no progress although requests are unfinished")
        for request, _ in scheduled.scheduled:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = start
        num_decode = sum(1 for r, n in scheduled.scheduled
                         if n == 1 and r.output_token_ids and r.num_uncomputed_tokens == 1)
        self.runner.swap(scheduled)
        sampled = self.runner.execute(scheduled, self.kv)
        finished = self.scheduler.update(scheduled, sampled)
        end = self.now()
        for request, _ in scheduled.scheduled:
            if request.request_id in sampled:
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = end
                request.metrics.token_times.append(end)
        for request in finished:
            self._retire(request, end)
        self.step_log.append({
            "step": len(self.step_log), "start": start, "end": end,
            "scheduled": [[r.request_id, n] for r, n in scheduled.scheduled],
            "batch_size": len(scheduled.scheduled),
            "num_prefill_tokens": scheduled.num_batched_tokens - num_decode,
            "num_decode_tokens": num_decode,
            "preempted": [r.request_id for r in scheduled.preempted],
            "num_swapped_blocks": len(scheduled.blocks_to_swap_out) + len(scheduled.blocks_to_swap_in),
            "num_free_blocks_before": free_before,
            "num_free_blocks": self.kv.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        })
        outputs += [self._output(r, [sampled[r.request_id]]) for r, _ in scheduled.scheduled
                    if r.request_id in sampled]
        return outputs

    def _retire(self, request: Request, when: float) -> None:
        request.metrics.finish_time = when
        self.runner.drop_generator(request.request_id)
        self.finished.append(request)

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        finished = request.status is RequestStatus.FINISHED
        text = None
        if finished and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        return RequestOutput(request.request_id, request.prompt_token_ids,
                             list(request.output_token_ids), new_token_ids, finished,
                             request.finish_reason, request.metrics, text)

    # -- what happened -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Pool counters now, plus this run's preemptions, prefix hits and per-step log."""
        return {
            "num_kv_blocks": self.kv.num_blocks,
            "block_size": self.kv.block_size,
            "num_free_blocks": self.kv.num_free_blocks,
            "num_cached_blocks": self.kv.num_cached_blocks,
            "num_used_blocks": self.kv.num_used_blocks,
            "kv_utilization": self.kv.utilization(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "steps": self.step_log,
        }

    def metrics_record(self, slo=None) -> dict:
        """This run as one JSON-ready dictionary (what ``diagnose`` reads): model, device, engine
        settings, memory, the step log, every finished request and the summary."""
        cfg = self.config
        kv_bytes_per_block = (self.runner.kv_cache[:, :, 0].numel()
                              * self.runner.kv_cache.element_size())
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        device = self.model.device
        requests = [{"request_id": r.request_id, "finish_reason": r.finish_reason,
                     "num_prefix_hit_tokens": r.num_prefix_hit_tokens,
                     "num_preemptions": r.num_preemptions, **r.metrics.to_dict()}
                    for r in self.finished]
        return {
            "format": METRICS_FORMAT,
            "version": 1,
            "model": asdict(cfg),
            "device": {"type": device.type,
                       "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "total_memory_bytes": (torch.cuda.get_device_properties(device).total_memory
                                              if device.type == "cuda" else None)},
            "dtype": str(self.runner.kv_cache.dtype).removeprefix("torch."),
            "engine": self.settings,
            "memory": {"weight_bytes": weight_bytes, "kv_bytes_per_block": kv_bytes_per_block,
                       "kv_cache_bytes": kv_bytes_per_block * self.kv.num_blocks,
                       "plan": _plan_dict(self.memory_plan)},
            "stats": self.stats(),
            "requests": requests,
            "summary": summarize([r.metrics for r in self.finished], slo) if self.finished else None,
        }

    def save_metrics(self, path, slo=None) -> Path:
        """Write :meth:`metrics_record` as JSON to ``path``; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.metrics_record(slo), indent=1))
        return path


class LLM(LLMEngine):
    """The engine with an offline front door: ``generate`` runs a list of prompts to completion."""

    def generate(self, prompts, params=None, use_tqdm: bool = True,
                 arrival_times: list[float] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order.

        ``params``: one ``SamplingParams`` for all or one per prompt. ``arrival_times``: seconds
        after the call at which each request arrives (online replay: a request is added when the
        clock passes its arrival); default all at once. Each call starts a new run of
        :meth:`stats`.
        """
        prompts = list(prompts)
        params_list = _per_prompt(params, len(prompts))
        if arrival_times is None:
            arrival_times = [0.0] * len(prompts)
        elif len(arrival_times) != len(prompts) or any(t < 0 for t in arrival_times):
            raise ValueError("arrival_times must be one non-negative offset (seconds) per prompt")
        if self.has_unfinished():
            raise ValueError("the engine still has unfinished requests; finish or abort them first")
        self.reset_metrics()
        order = sorted(range(len(prompts)), key=lambda i: arrival_times[i])
        ids = [self.next_request_id() for _ in prompts]
        results: dict[str, RequestOutput] = {}
        progress = _progress_bar(len(prompts), use_tqdm)
        start = self.now()
        try:
            while len(results) < len(prompts):
                while order and start + arrival_times[order[0]] <= self.now():
                    i = order.pop(0)
                    self.add_request(ids[i], prompts[i], params_list[i],
                                     arrival_time=start + arrival_times[i])
                if not self.has_unfinished():  # idle until the next arrival
                    time.sleep(max(0.0, start + arrival_times[order[0]] - self.now()))
                    continue
                for output in self.step():
                    if output.finished:
                        results[output.request_id] = output
                        progress.update(1)
        except BaseException:  # a bad prompt or an interrupt: nothing stays queued
            for request_id in list(self.scheduler.requests):
                self.abort(request_id)
            self._aborted.clear()
            raise
        finally:
            progress.close()
        return [results[i] for i in ids]


def _load(model, device, dtype, weights) -> Transformer:
    """An already built Transformer as is, or load one (path, preset or hub id)."""
    if isinstance(model, Transformer):
        if device is not None and torch.device(device).type != model.device.type:
            raise ValueError(f"device={device} but the given model is on {model.device}")
        if dtype is not None and dtype != model.dtype:
            raise ValueError(f"dtype={dtype} but the given model is {model.dtype}")
        return model
    return load_model(model, device=device, dtype=dtype, weights=weights)


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"params: got {len(params)} SamplingParams for {count} prompts")
    return params


def _plan_dict(plan) -> dict | None:
    if plan is None:
        return None
    return asdict(plan) if hasattr(plan, "__dataclass_fields__") else dict(vars(plan))


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="req")
