"""The offline front door (chapters 一次请求的一生 and 调度): ``LLM.generate`` runs a list of
prompts to completion and returns the outputs in input order, optionally replaying their arrival
times."""
from __future__ import annotations

import time

from minillm.engine.engine import LLMEngine
from minillm.engine.request import RequestOutput
from minillm.engine.sampling import SamplingParams


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
        progress = progress_bar(len(prompts), use_tqdm, "generate")
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


    def chat(self, conversations, params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer each conversation (a list of ``{"role", "content"}`` messages, or a list of such
        lists) through the model's chat template, as ``generate`` does for prompts."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.chat_prompt_ids(list(c)) for c in conversations], params, use_tqdm)


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"params: got {len(params)} SamplingParams for {count} prompts")
    return params


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, desc: str):
    """A tqdm bar of ``total`` requests named ``desc``, or one that shows nothing."""
    if not enabled:
        return _NoProgress()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="req")
