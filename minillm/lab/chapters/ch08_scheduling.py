"""What chapter 9's kit and page still import from chapter 调度's former kit (issue 30): the steps
of the chapter's contract under chunked prefill, now the ledger's
(:func:`minillm.lab.estimate.chunked_prefill`). Delete this file when chapter 9 is rewritten."""
from __future__ import annotations

from minillm.engine.config import load_config
from minillm.engine.engine_config import EngineConfig
from minillm.lab.estimate import ChunkedPrefill as ContractSteps, chunked_prefill  # noqa: F401
from minillm.lab.gpus import lookup_gpu
from minillm.lab.report import BOUND_WORDS as BOUND  # noqa: F401

COLLEAGUES, SLOTS, CONTRACT, SCENE_CTX, SCENE_GPU = 20, 8, 8192, 1024, "H100 SXM"


def contract_steps(cfg, prompt_len: int, budget: int, running: int, ctx: int, peak_flops: float,
                   bandwidth: float, dtype="bf16", device: str = "") -> ContractSteps:
    """:func:`chunked_prefill` under its former name (``device`` is no longer kept)."""
    return chunked_prefill(cfg, prompt_len, budget, running, ctx, peak_flops, bandwidth, dtype)


def contract_on_gpu(gpu: str = SCENE_GPU, budget: int | None = None) -> ContractSteps:
    """The chapter's contract on a GPU's datasheet: Llama-3.1-8B in bf16, the seven other colleagues
    decoding at context 1,024, the engine's default step budget unless ``budget``."""
    spec = lookup_gpu(gpu)
    return chunked_prefill(load_config("llama-3.1-8b"), CONTRACT, budget or EngineConfig().max_num_batched_tokens,
                           SLOTS - 1, SCENE_CTX, spec.bf16_flops, spec.bandwidth)
