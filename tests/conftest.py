"""Shared fixtures (a server that is slow to start starts once), how Triton runs (compiled on a
GPU, under its interpreter without one) and where minillm's cache goes.

Triton reads TRITON_INTERPRET once, when it is first imported; conftest is imported before any
test module (and so before anything imports minillm and, through it, Triton).
"""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# What minillm derives from a model once (the GGUF's tokenizer) goes to a fresh folder, shared by
# this run's tests and the servers they start, never to the user's cache.
os.environ["MINILLM_CACHE"] = tempfile.mkdtemp(prefix="minillm-test-cache-")
atexit.register(shutil.rmtree, os.environ["MINILLM_CACHE"], ignore_errors=True)


@pytest.fixture(scope="module")
def one_thread():
    """Engine runs on tiny shapes are faster on one thread, and do not suffer from a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm_server():
    """SmolLM2-135M (its real weights and tokenizer) served on one thread, KV blocks for its whole
    context (8192 tokens), started once for every test that needs the real model behind HTTP and
    no setting of its own."""
    from minillm.server.launcher import serve_in_background

    with serve_in_background("smollm2-135m", served_model_name="smol", num_kv_blocks=512,
                             env={"OMP_NUM_THREADS": "1"}) as server:
        yield server


@pytest.fixture(scope="session")
def chat_server(tmp_path_factory):
    """The tiny chat model of test_server (a trained byte-level BPE tokenizer, a chat template) in
    float32 behind an API key, started once for every test file that needs no other setting."""
    from test_server import API_KEY, save_chat_model

    from minillm.server.launcher import serve_in_background

    folder = tmp_path_factory.mktemp("chat-model")
    save_chat_model(folder)
    with serve_in_background(folder, served_model_name="tiny-chat", api_key=API_KEY,
                             num_kv_blocks=64, block_size=8, max_model_len=256) as server:
        server.tokenizer_dir = folder
        yield server
