"""minillm: the small, readable LLM inference engine of the minillm-book."""
from minillm.generate import generate
from minillm.loader import load_model
from minillm.sampling import SamplingParams

__all__ = ["SamplingParams", "generate", "load_model"]
