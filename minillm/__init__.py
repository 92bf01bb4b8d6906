"""minillm: the small, readable LLM inference engine of the minillm-book.

``minillm.engine`` is the engine (torch); ``minillm.lab`` is the measurement kit the book's labs use
(the ledger, probes, benchmarks, records, diagnosis, plots); ``minillm.server`` serves the engine
over HTTP. The public names load lazily, so ``import minillm.lab.estimate`` needs no torch.
"""
__version__ = "0.1.0"  # pyproject.toml's version (tests/test_server_hardening.py checks)
__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "generate", "load_model"]

_HOMES = {"LLM": "minillm.engine.llm", "LLMEngine": "minillm.engine.engine",
          "SamplingParams": "minillm.engine.sampling", "StructuredOutputsParams": "minillm.engine.structured",
          "generate": "minillm.engine.generate",
          "load_model": "minillm.engine.loader"}


def __getattr__(name):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
