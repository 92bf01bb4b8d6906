"""minillm: the small, readable LLM inference engine of the minillm-book."""
from minillm.generate import generate
from minillm.loader import load_model
from minillm.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "generate", "load_model"]


def __getattr__(name):
    """``LLM`` and ``LLMEngine`` load the whole engine, so they are imported on first use."""
    if name in ("LLM", "LLMEngine"):
        from minillm import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
