"""The server in a subprocess, for notebooks, tests and benchmarks (chapter: serving over HTTP)::

    with serve_in_background("tiny", weights="random", num_kv_blocks=256) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        ...

starts ``python -m minillm serve`` on 127.0.0.1 and a free port, waits until ``/health`` answers,
and on leaving the block sends SIGTERM and waits for the server's clean exit (code 0).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # where ``import minillm`` finds this copy


@dataclass
class ServerProcess:
    """A running ``python -m minillm serve``: where it listens, what it serves, its output."""

    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    model: str  # the served model name
    log_path: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        """What the ``openai`` client takes as ``base_url``."""
        return self.url + "/v1"

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit (killed after ``timeout`` s); its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_command(model, host: str, port: int, **options) -> list[str]:
    """``python -m minillm serve MODEL ...``; ``options`` as keywords (``num_kv_blocks=64`` is
    ``--num-kv-blocks 64``, ``True`` a bare flag, ``None`` and ``False`` left out)."""
    command = [sys.executable, "-m", "minillm", "serve", str(model), "--host", host, "--port", str(port)]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            command.append(flag)
        elif value is not None and value is not False:
            command += [flag, str(value)]
    return command


@contextlib.contextmanager
def serve_in_background(model, *, host: str = "127.0.0.1", port: int | None = None,
                        startup_timeout: float = 300.0, env: dict[str, str] | None = None,
                        **options) -> Iterator[ServerProcess]:
    """Start the server on ``host`` (a free port unless ``port``), yield it once it is healthy,
    stop it on exit. ``options`` are the ``serve`` command's options as keywords; ``env``: more
    environment variables for the server (e.g. ``OMP_NUM_THREADS``)."""
    port = free_port(host) if port is None else port
    log_file = tempfile.NamedTemporaryFile(prefix="minillm-serve-", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(serve_command(model, host, port, **options), stdout=log_file,
                               stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, f"http://{host}:{port}", options.get("served_model_name") or str(model),
                           Path(log_file.name), options.get("api_key"))
    try:
        _wait_until_healthy(server, startup_timeout)
        yield server
    finally:
        server.stop()
        log_file.close()
    server.log_path.unlink(missing_ok=True)  # kept when something went wrong, for reading


def _wait_until_healthy(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.process.returncode} before it "
                               f"was ready; its output:\n{server.log()[-3000:]}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s; its output:\n"
                       f"{server.log()[-3000:]}")
