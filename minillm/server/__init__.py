"""The server (chapter: serving over HTTP): vLLM's OpenAI API over the engine, Prometheus metrics,
and a launcher for notebooks and tests. It imports the engine; the engine never imports it.

| file | holds |
| --- | --- |
| ``protocol.py`` | request bodies, OpenAI's error body, checks into the engine's ``SamplingParams`` |
| ``metrics.py`` | the Prometheus collectors (``minillm:`` names), fed after every step |
| ``async_engine.py`` | the loop that steps the engine for an event loop; per-request output streams |
| ``api_server.py`` | the FastAPI app, the endpoints, server-sent events, ``serve`` |
| ``cli.py`` | ``python -m minillm serve MODEL`` |
| ``launcher.py`` | ``serve_in_background``: the server in a subprocess, stopped on exit |
"""
