"""Public vLLM start-up logs, and minillm's dry run beside them (chapter 一张 24 GiB 的卡放 8B 模型).

``data/vllm_startup_logs.json`` holds, for each log, where it was read, its lines verbatim, the
numbers parsed from them and the settings its vLLM version's defaults fix; and what some cards
report to torch as their memory. ``dry_run`` plans minillm for the same model, card and settings;
``beside_vllm`` sets the two block counts side by side.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from minillm.engine.config import ModelConfig, load_config
from minillm.engine.kv_cache import kv_bytes_per_token
from minillm.engine.loader import torch_dtype
from minillm.engine.memory_plan import MemoryPlan
from minillm.engine.planner import plan
from minillm.engine.units import GiB

LOGS_JSON = Path(__file__).resolve().parents[2] / "data" / "vllm_startup_logs.json"


@functools.cache
def _data() -> dict:
    return json.loads(LOGS_JSON.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class StartupLog:
    """One log of ``data/vllm_startup_logs.json`` (its fields are documented there)."""

    id: str
    url: str
    gpu: str
    model: str
    minillm_model: str
    config_changes: dict
    vllm: str
    excerpt: tuple[str, ...]
    reported: dict
    defaults: dict

    @property
    def config(self) -> ModelConfig:
        """The minillm config with the served model's shapes."""
        return load_config(self.minillm_model).replace(**self.config_changes)

    @property
    def total_bytes(self) -> int:
        """The card's memory as torch reported it."""
        return round(self.reported["total_gpu_memory_gib"] * GiB)

    def setting(self, name: str):
        """A setting as the log prints it, else as its vLLM version's defaults fix it."""
        return self.reported.get(name) or self.defaults[name]

    @property
    def blocks(self) -> int:
        """vLLM's KV blocks: as printed, else the KV memory it printed in whole blocks."""
        if self.reported["gpu_blocks"] is not None:
            return self.reported["gpu_blocks"]
        config = self.config
        block_bytes = self.setting("block_size") * kv_bytes_per_token(config, torch_dtype(config.torch_dtype))
        return int(self.reported["kv_cache_gib"] * GiB) // block_bytes


def startup_logs() -> tuple[StartupLog, ...]:
    """Every log of the data file, in file order."""
    names = [field.name for field in dataclasses.fields(StartupLog)]
    return tuple(StartupLog(**{**{name: log[name] for name in names}, "excerpt": tuple(log["excerpt"])})
                 for log in _data()["logs"])


def startup_log(log_id: str) -> StartupLog:
    """The log named ``log_id``."""
    for log in startup_logs():
        if log.id == log_id:
            return log
    raise ValueError(f"no vLLM log {log_id!r} (known: {', '.join(log.id for log in startup_logs())})")


def reported_memory(gpu: str) -> int:
    """Bytes a card reports to torch as its memory, as read in a public log: what to plan a real
    card with (a "24 GB" card reports less than 24 GiB)."""
    for card in _data()["reported_memory"]:
        if card["gpu"].lower() == gpu.lower():
            return round(card["total_gib"] * GiB)
    known = ", ".join(card["gpu"] for card in _data()["reported_memory"])
    raise ValueError(f"no reported memory for {gpu!r} (known: {known})")


def dry_run(log: StartupLog, max_model_len: int = -1) -> MemoryPlan:
    """minillm's dry run for the log's model, card and settings; by default ``max_model_len=-1``,
    the longest length that fits, so that a plan comes back where vLLM refused the log's length."""
    return plan(log.config, gpu_memory=log.total_bytes,
                gpu_memory_utilization=log.reported["gpu_memory_utilization"],
                block_size=log.setting("block_size"), max_num_seqs=log.setting("max_num_seqs"),
                max_num_batched_tokens=log.setting("max_num_batched_tokens"), max_model_len=max_model_len)


def beside_vllm(log: StartupLog) -> dict:
    """vLLM's KV blocks and minillm's for the same card, and their relative difference."""
    ours = dry_run(log)
    return {"log": log.id, "gpu": log.gpu, "vllm_blocks": log.blocks, "minillm_blocks": ours.num_blocks,
            "difference": ours.num_blocks / log.blocks - 1, "plan": ours}
