"""Synthetic request streams for the labs (chapters 一次请求的一生 and 调度).

A :class:`Workload` is what a serving benchmark replays: prompts (random token ids), sampling
params and arrival offsets in seconds. Arrivals are all at once (offline) or a Poisson process at
a rate (online); lengths come from a uniform mix, a lognormal chat-like mix, or "one 8K contract
among short questions". Everything is seeded, so a lab reruns the same stream.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from minillm.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Workload:
    """Requests to replay: ``prompts[i]`` arrives ``arrival_times[i]`` seconds after the start."""

    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrival_times: list[float]

    def __post_init__(self):
        if not len(self.prompts) == len(self.params) == len(self.arrival_times):
            raise ValueError("prompts, params and arrival_times must have one entry per request")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def input_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def output_lens(self) -> list[int]:
        """Requested output lengths (``max_tokens``; exact when ``ignore_eos``)."""
        return [p.max_tokens for p in self.params]

    def with_arrivals(self, arrival_times: list[float]) -> Workload:
        """The same requests arriving at other times (e.g. ``poisson_arrivals``)."""
        return replace(self, arrival_times=list(arrival_times))

    def run(self, llm, use_tqdm: bool = False):
        """Replay on an ``LLM``: each request is added when the clock passes its arrival time."""
        return llm.generate(self.prompts, self.params, use_tqdm=use_tqdm,
                            arrival_times=self.arrival_times)


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of a Poisson process of ``rate`` requests/s; ``inf`` = all at 0."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def uniform_lengths(num_requests: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Lengths drawn uniformly from [low, high]."""
    _check_range("length", low, high)
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(num_requests)]


def lognormal_lengths(num_requests: int, median: float, sigma: float, low: int = 1,
                      high: int | None = None, seed: int = 0) -> list[int]:
    """Chat-like lengths: lognormal around ``median`` (most short, a long tail), clipped to
    [low, high]."""
    if not median > 0 or not sigma >= 0:
        raise ValueError(f"median must be > 0 and sigma >= 0, got median={median}, sigma={sigma}")
    _check_range("length", low, high if high is not None else low)
    rng = random.Random(seed)
    lengths = (round(rng.lognormvariate(math.log(median), sigma)) for _ in range(num_requests))
    return [max(low, n if high is None else min(high, n)) for n in lengths]


def random_prompts(input_lens: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids, one prompt per length."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in input_lens]


def make_workload(name: str, input_lens: list[int], output_lens: list[int], vocab_size: int, *,
                  arrival_times: list[float] | None = None, temperature: float = 0.0,
                  ignore_eos: bool = True, seed: int = 0) -> Workload:
    """Random prompts of ``input_lens`` asking for exactly ``output_lens`` tokens (``ignore_eos``)."""
    if len(input_lens) != len(output_lens):
        raise ValueError("input_lens and output_lens must have one entry per request")
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=ignore_eos)
              for n in output_lens]
    arrivals = [0.0] * len(input_lens) if arrival_times is None else list(arrival_times)
    return Workload(name, random_prompts(input_lens, vocab_size, seed), params, arrivals)


def uniform_workload(num_requests: int, vocab_size: int, input_range=(100, 1024),
                     output_range=(100, 1024), rate: float = math.inf, seed: int = 0) -> Workload:
    """Input and output lengths uniform in their ranges; Poisson arrivals at ``rate``."""
    return make_workload(
        "uniform", uniform_lengths(num_requests, *input_range, seed=seed),
        uniform_lengths(num_requests, *output_range, seed=seed + 1), vocab_size,
        arrival_times=poisson_arrivals(num_requests, rate, seed=seed + 2), seed=seed + 3)


def chat_workload(num_requests: int, vocab_size: int, input_median: int = 256,
                  output_median: int = 128, sigma: float = 0.8, max_len: int = 2048,
                  rate: float = math.inf, seed: int = 0) -> Workload:
    """Chat-like: lognormal input and output lengths (clipped to ``max_len``); Poisson arrivals."""
    return make_workload(
        "chat", lognormal_lengths(num_requests, input_median, sigma, high=max_len, seed=seed),
        lognormal_lengths(num_requests, output_median, sigma, high=max_len, seed=seed + 1),
        vocab_size, arrival_times=poisson_arrivals(num_requests, rate, seed=seed + 2),
        seed=seed + 3)


def contract_workload(vocab_size: int, num_requests: int = 20, contract_len: int = 8192,
                      question_range=(16, 128), output_len: int = 64,
                      contract_index: int | None = None, rate: float = math.inf,
                      seed: int = 0) -> Workload:
    """One long contract among short questions (the book's twenty colleagues): request
    ``contract_index`` (default the middle one) has ``contract_len`` prompt tokens, the others
    ``question_range``; every request asks for ``output_len`` tokens."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    index = num_requests // 2 if contract_index is None else contract_index
    if not 0 <= index < num_requests:
        raise ValueError(f"contract_index must be in [0, {num_requests}), got {contract_index}")
    input_lens = uniform_lengths(num_requests, *question_range, seed=seed)
    input_lens[index] = contract_len
    return make_workload("contract", input_lens, [output_len] * num_requests, vocab_size,
                         arrival_times=poisson_arrivals(num_requests, rate, seed=seed + 2),
                         seed=seed + 3)


def throughput_workload(vocab_size: int, num_requests: int = 256, length_range=(100, 1024),
                        scale: float = 1.0, seed: int = 0) -> Workload:
    """The standard offline throughput benchmark: ``num_requests`` requests, input and output
    lengths uniform in ``length_range``, random ids, ``ignore_eos``, all arriving at once.
    ``scale`` shrinks the request count and both lengths (e.g. 0.125 for a CPU)."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    low, high = (max(1, round(n * scale)) for n in length_range)
    count = max(1, round(num_requests * scale))
    workload = uniform_workload(count, vocab_size, (low, high), (low, high), seed=seed)
    return replace(workload, name="throughput")


def _check_range(name: str, low: int, high: int) -> None:
    if not 1 <= low <= high:
        raise ValueError(f"{name} range must satisfy 1 <= low <= high, got [{low}, {high}]")
