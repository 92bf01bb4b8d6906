"""The engine (chapters 1-8): model, loader, kernels, sampling, KV caches, paging, planner,
scheduler, model runner, ``LLMEngine`` and the offline ``LLM``. It imports nothing from the lab kit
or the server; see ``minillm/README.md`` for the module map."""
