"""The OpenAI-compatible server (chapter: serving over HTTP), started for real on 127.0.0.1 and
driven with the official ``openai`` client and httpx: streamed and gathered answers agree,
concurrency changes no token (float64), chat goes through the chat template, every bad input gets
its status and OpenAI's error body with nothing queued (unknown fields refused by name, counted by
reason, the parameter named as the client sent it), vLLM's min_tokens and continuous usage stats,
the sampling fields (n, logprobs in both shapes, echo, with logprobs too, penalties, logit_bias, min_p, stop)
through the official client, vLLM's metric meanings (prompts counted once, every token gap), a client that hangs up frees its KV blocks
within a second, a full queue answers 503, SIGTERM exits 0, and a soak of a few hundred requests
with random hang-ups loses no request and leaks no block."""
import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from minillm.lab import loadgen, records
from minillm.lab.diagnose import diagnose_client
from minillm.server.launcher import serve_in_background

API_KEY = "sk-test"
TRAINING_TEXT = ["The KV cache holds the keys and values of every token seen so far.",
                 "Twenty colleagues share one model behind an interface; one pastes a contract.",
                 "预填充一次处理整段输入，解码每步只算一个新 token。",
                 "Hello world, hello server, hello stream."] * 20
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
EXACT_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


def save_chat_model(folder: Path) -> None:
    """A tiny random Llama with a byte-level BPE tokenizer trained here and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def exact_server(tmp_path_factory):
    """A preset-style config (no tokenizer) with random weights in float64, for exact comparisons."""
    folder = tmp_path_factory.mktemp("exact-model")
    (folder / "config.json").write_text(json.dumps(EXACT_CONFIG))
    with serve_in_background(folder, served_model_name="tiny-exact", weights="random",
                             dtype="float64", num_kv_blocks=256, block_size=4,
                             max_model_len=512) as server:
        yield server


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "none", max_retries=0)


def scrape(server) -> dict[str, float]:
    """Every sample of /metrics by name (labels summed); the text must parse as Prometheus'."""
    values: dict[str, float] = {}
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_until_idle(server, within: float = 1.0) -> dict[str, float]:
    """The metrics once nothing runs, waits or holds a KV block; fails after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        values = scrape(server)
        if (values["minillm:num_requests_running"], values["minillm:num_requests_waiting"],
                values["minillm:kv_cache_usage_perc"]) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert values["minillm:num_requests_running"] == 0
    assert values["minillm:num_requests_waiting"] == 0
    assert values["minillm:kv_cache_usage_perc"] == 0
    return values


def finished_requests(values: dict[str, float]) -> float:
    return values["minillm:request_success_total"]


def rejected(server) -> dict[str, float]:
    """``minillm:request_rejected_total`` by reason, from the parsed Prometheus text."""
    text = httpx.get(server.url + "/metrics").text
    return {sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(text) if family.name == "minillm:request_rejected"
            for sample in family.samples if sample.name == "minillm:request_rejected_total"}


# --- one owner for the served numbers ---------------------------------------------------------------

def test_metrics_and_the_run_record_read_one_snapshot_and_reset_nothing():
    """The server's collectors read the engine's snapshot after each step and feed their
    histograms from the outputs: the Prometheus text says what the snapshot and the run record say,
    and the engine keeps its whole run, so a served run can still be recorded."""
    from minillm import LLMEngine
    from minillm.engine.config import ModelConfig
    from minillm.engine.loader import load_model
    from minillm.engine.sampling import SamplingParams
    from minillm.server.metrics import ServerMetrics

    model = load_model(ModelConfig.from_dict(EXACT_CONFIG, "tiny-exact"), device="cpu",
                       dtype=torch.float64, weights="random")
    engine = LLMEngine(model, num_kv_blocks=64, block_size=4)
    metrics = ServerMetrics("m", engine.snapshot(), engine.config)
    for i, prompt in enumerate(exact_prompts(3)):
        engine.add_request(i, prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished():
        outputs = engine.step()
        metrics.observe(engine.snapshot(), outputs)
    values = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode())
              for s in f.samples if s.labels.get("finished_reason") in (None, "length")}
    snapshot, record = engine.snapshot(), records.run_record(engine)
    assert values["minillm:generation_tokens_total"] == snapshot["generation_tokens"] == 15
    assert values["minillm:prompt_tokens_total"] == sum(r["num_prompt_tokens"] for r in record["requests"])
    assert values["minillm:request_success_total"] == snapshot["num_finished_length"] == 3
    assert values["minillm:inter_token_latency_seconds_count"] == 3 * 4
    assert values["minillm:time_to_first_token_seconds_count"] == 3
    assert len(record["requests"]) == 3 and len(record["stats"]["steps"]) == snapshot["num_steps"]
    assert record["stats"]["generation_tokens"] == 15


# --- the API --------------------------------------------------------------------------------------

def test_health_models_and_metrics_names(chat_server):
    assert httpx.get(chat_server.url + "/health").status_code == 200  # no key needed
    models = client_for(chat_server).models.list().data
    assert [m.id for m in models] == ["tiny-chat"] and models[0].max_model_len == 256
    values = scrape(chat_server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "request_time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert "minillm:" + name in values, name
    assert "minillm:time_per_output_token_seconds_count" not in values  # vLLM's retired name


def test_streamed_and_gathered_greedy_text_agree(chat_server):
    from transformers import AutoTokenizer

    client = client_for(chat_server)
    extra = {"return_token_ids": True, "ignore_eos": True}
    before = scrape(chat_server)
    whole = client.completions.create(model="tiny-chat", prompt="Hello world, the KV cache",
                                      max_tokens=24, temperature=0, extra_body=extra)
    chunks = list(client.completions.create(
        model="tiny-chat", prompt="Hello world, the KV cache", max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra))
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 24
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert sum((c.choices[0].token_ids for c in chunks if c.choices), []) == choice.token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens == 24
    tokenizer = AutoTokenizer.from_pretrained(chat_server.tokenizer_dir)
    assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert whole.usage.prompt_tokens == len(tokenizer.encode("Hello world, the KV cache"))
    after = wait_until_idle(chat_server)
    for name, added in (("generation_tokens_total", 48), ("time_to_first_token_seconds_count", 2)):
        assert after["minillm:" + name] - before["minillm:" + name] == added


def test_a_list_of_prompts_gets_one_choice_each(chat_server):
    client = client_for(chat_server)
    prompts = ["Hello", "Twenty colleagues"]
    together = client.completions.create(model="tiny-chat", prompt=prompts, max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(model="tiny-chat", prompt=p, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert [c.index for c in together.choices] == [0, 1]
    assert [c.text for c in together.choices] == alone
    assert together.usage.completion_tokens == 12


def test_stop_strings_cut_the_text_before_them(chat_server):
    client = client_for(chat_server)
    args = dict(model="tiny-chat", prompt="Hello server", max_tokens=32, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    stop = full[10:13]
    cut = full[:full.index(stop)]
    stopped = client.completions.create(**args, stop=[stop, "never seen"]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_until_idle(chat_server)


def test_n_choices_are_indexed_streamed_and_count_the_prompt_once(chat_server):
    client = client_for(chat_server)
    args = dict(model="tiny-chat", max_tokens=8, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="Hello world, the KV cache", n=3, **args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.text for c in whole.choices}) > 1  # seeds 5, 6, 7: three different answers
    alone = client.completions.create(prompt="Hello world, the KV cache", n=1, **args)
    assert alone.choices[0].text == whole.choices[0].text  # the first answer draws from seed 5
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens == alone.usage.prompt_tokens
    texts = {}
    for chunk in client.completions.create(prompt="Hello world, the KV cache", n=3, stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}

    greedy = dict(model="tiny-chat", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    two = client.completions.create(prompt=["Hello", "Twenty colleagues"], n=2, **greedy)
    single = [client.completions.create(prompt=p, **greedy).choices[0].text for p in ("Hello", "Twenty colleagues")]
    assert [c.text for c in two.choices] == [single[0]] * 2 + [single[1]] * 2
    messages = [{"role": "user", "content": "Hello server"}]
    chat = client.chat.completions.create(model="tiny-chat", messages=messages, n=2, max_tokens=6, seed=1)
    streamed = {}
    for chunk in client.chat.completions.create(model="tiny-chat", messages=messages, n=2, max_tokens=6,
                                                seed=1, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {c.index: c.message.content for c in chat.choices}
    wait_until_idle(chat_server)


def test_logprobs_in_openais_two_shapes_streamed_too(chat_server):
    client = client_for(chat_server)
    args = dict(model="tiny-chat", prompt="Hello server", max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(logprobs=3, **args).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and value < 0 and top[token] == value  # tokens may read alike: "\ufffd"
        assert value == max(top.values())  # greedy takes the most likely token
    assert [b - a for a, b in zip(lp.text_offset, lp.text_offset[1:])] == [len(t) for t in lp.tokens[:-1]]
    chunks = list(client.completions.create(logprobs=3, stream=True, **args))
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == lp.token_logprobs
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == lp.text_offset
    assert client.completions.create(**args).choices[0].logprobs is None

    messages = [{"role": "user", "content": "Hello server"}]
    chat = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())
    streamed = [e for c in client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        stream=True) if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs=true"):
        client.chat.completions.create(model="tiny-chat", messages=messages, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match=r"top_logprobs must be None or an int in \[0, 20\]") as caught:
        client.chat.completions.create(model="tiny-chat", messages=messages, logprobs=True, top_logprobs=21)
    assert caught.value.body["param"] == "top_logprobs"
    wait_until_idle(chat_server)


def test_echo_puts_the_prompt_before_the_answer(chat_server):
    client = client_for(chat_server)
    args = dict(model="tiny-chat", prompt="Hello server", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0].text
    assert client.completions.create(echo=True, **args).choices[0].text == "Hello server" + plain
    chunks = list(client.completions.create(echo=True, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == "Hello server" + plain


def test_echo_with_logprobs_lists_the_prompts_tokens_first(chat_server):
    """vLLM's echo with logprobs: the prompt's tokens (null for the first) then the generated ones,
    each prompt token's logprob transformers' float32 log_softmax at the position before it, the
    generated ones as without echo, text offsets from 0; streamed the same, n answers each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = client_for(chat_server)
    args = dict(model="tiny-chat", prompt="Hello server", max_tokens=5, temperature=0, logprobs=2,
                extra_body={"ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(chat_server.tokenizer_dir)
    ids = tokenizer.encode("Hello server")
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(chat_server.tokenizer_dir, dtype=torch.float32)
        reference = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    plain = client.completions.create(**args).choices[0]
    whole = client.completions.create(echo=True, **args)
    assert whole.usage.prompt_tokens == len(ids) and whole.choices[0].text == "Hello server" + plain.text
    lp = whole.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([reference[k - 1, ids[k]].item()
                                                          for k in range(1, len(ids))], abs=1e-5)
    for k in range(1, len(ids)):  # the top 2 and the token itself (tokens may read alike: "\ufffd")
        best = reference[k - 1].topk(2)
        expected = {**{tokenizer.decode([t]): v for t, v in zip(best.indices.tolist(), best.values.tolist())},
                    lp.tokens[k]: lp.token_logprobs[k]}
        assert lp.top_logprobs[k] == pytest.approx(expected, abs=1e-5)
    assert lp.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    assert lp.top_logprobs[len(ids):] == plain.logprobs.top_logprobs
    assert lp.text_offset == [sum(map(len, lp.tokens[:k])) for k in range(len(lp.tokens))]

    chunks = list(client.completions.create(echo=True, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(c.choices[0].logprobs, name) for c in chunks), []) == getattr(lp, name)
    both = client.completions.create(echo=True, n=2, **args).choices
    for choice in both:  # batched together: float32 sums in another order
        assert choice.logprobs.tokens == lp.tokens and choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    wait_until_idle(chat_server)


def test_penalties_bias_min_p_and_stop_answer_as_the_offline_engine_does(chat_server):
    """The server passes every sampling field to the engine: its answer is the offline ``LLM``'s
    for the same params, token for token; a +100 bias forces its token."""
    from minillm import LLM, SamplingParams

    client = client_for(chat_server)
    llm = LLM(chat_server.tokenizer_dir, device="cpu", num_kv_blocks=64, block_size=8, max_model_len=256)
    prompt, forced = "Hello world, hello", llm.prompt_token_ids(" stream")[0]
    fields = dict(temperature=0.9, seed=3, max_tokens=16, presence_penalty=0.5, frequency_penalty=1.0,
                  logit_bias={7: 4.0, 9: -3.0})
    extra = dict(repetition_penalty=1.3, min_p=0.05, ignore_eos=True)
    served = client.completions.create(model="tiny-chat", prompt=prompt, extra_body={**extra, "return_token_ids": True},
                                       **{**fields, "logit_bias": {"7": 4.0, "9": -3.0}}).choices[0]
    (offline,) = llm.generate([prompt], SamplingParams(**fields, **extra), use_tqdm=False)
    assert served.token_ids == offline.token_ids and served.text == offline.text
    plain = llm.generate([prompt], SamplingParams(temperature=0.9, seed=3, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0]
    assert plain.token_ids != offline.token_ids
    biased = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=4, logit_bias={str(forced): 100},
                                       extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert biased.token_ids == [forced] * 4
    stop = offline.text[4:7]
    stopped = client.completions.create(model="tiny-chat", prompt=prompt, stop=stop, extra_body=extra,
                                        **{**fields, "logit_bias": {"7": 4.0, "9": -3.0}}).choices[0]
    assert (stopped.text, stopped.finish_reason) == (offline.text[:offline.text.index(stop)], "stop")
    wait_until_idle(chat_server)


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(chat_server):
    """The token that would stop the answer is masked until min_tokens are out (the answer runs
    past it); a stop string counts only once min_tokens are out; min_tokens > max_tokens is a 400."""
    client = client_for(chat_server)
    args = dict(model="tiny-chat", prompt="Hello server", max_tokens=16, temperature=0)
    full = client.completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = full.choices[0].token_ids
    stop_at = next(i for i, t in enumerate(ids) if i >= 1 and t not in ids[:i])
    extra = {"ignore_eos": True, "return_token_ids": True, "stop_token_ids": [ids[stop_at]]}
    stopped = client.completions.create(**args, extra_body=extra).choices[0]
    assert (stopped.token_ids, stopped.finish_reason) == (ids[:stop_at + 1], "stop")
    held = client.completions.create(**args, extra_body={**extra, "min_tokens": 10}).choices[0]
    assert len(held.token_ids) >= 10 and ids[stop_at] not in held.token_ids[:10]
    assert held.token_ids[:stop_at] == ids[:stop_at]

    text = full.choices[0].text
    stop = text[3:6]
    held_text = client.completions.create(**args, stop=stop, extra_body={
        "ignore_eos": True, "min_tokens": 16}).choices[0]
    assert held_text.text.startswith(text[:text.index(stop)] + stop)  # ran past its first match
    assert text.startswith(held_text.text)
    with pytest.raises(openai.BadRequestError, match=r"min_tokens must be .*max_tokens=16"):
        client.completions.create(**args, extra_body={"min_tokens": 17})


def test_continuous_usage_stats_put_the_usage_in_every_chunk(chat_server):
    client = client_for(chat_server)
    args = dict(model="tiny-chat", max_tokens=5, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        prompt="Hello world", **args,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 5, 5]
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    chat = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello"}], **args,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in chat] == [0, 1, 2, 3, 4, 5, 5]
    plain = list(client.completions.create(prompt="Hello world", **args,
                                           stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * 5 + [True]


def test_metrics_count_prompts_once_and_every_token_gap(chat_server):
    """vLLM's meanings: prompt_tokens counts a prompt once, prefix hits included; the
    inter-token histogram gets one gap per token after the first, as they come."""
    client = client_for(chat_server)
    prompt = "Twenty colleagues share one model behind an interface; one pastes a contract."
    before = wait_until_idle(chat_server)
    for _ in range(2):
        answer = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=7,
                                           temperature=0, extra_body={"ignore_eos": True})
    after = wait_until_idle(chat_server)

    def added(name):
        return after["minillm:" + name] - before["minillm:" + name]
    assert added("prompt_tokens_total") == 2 * answer.usage.prompt_tokens
    assert 0 < added("prefix_cache_hits_total") < answer.usage.prompt_tokens  # the second one hit
    assert added("generation_tokens_total") == 14
    assert added("inter_token_latency_seconds_count") == 2 * 6
    for name in ("time_to_first_token_seconds_count", "request_time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count", "request_success_total"):
        assert added(name) == 2, name


def test_chat_uses_the_chat_template(chat_server):
    from transformers import AutoTokenizer

    client = client_for(chat_server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    answer = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=12,
                                            temperature=0, extra_body={"ignore_eos": True})
    stream = list(client.chat.completions.create(model="tiny-chat", messages=messages,
                                                 max_tokens=12, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert answer.choices[0].message.role == "assistant"
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == answer.choices[0].message.content
    tokenizer = AutoTokenizer.from_pretrained(chat_server.tokenizer_dir)
    rendered = "<s><|system|>Be brief.\n<|user|>Hello\n<|assistant|>"
    assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    completion = client.completions.create(
        model="tiny-chat", prompt=tokenizer.encode(rendered, add_special_tokens=False),
        max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == answer.choices[0].message.content


def test_the_api_key_is_required(chat_server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=chat_server.base_url, api_key="wrong", max_retries=0).models.list()
    response = httpx.post(chat_server.base_url + "/completions", json={"prompt": "x"})
    assert response.status_code == 401 and response.json()["error"]["code"] == 401


BAD_INPUTS = [  # (endpoint, body or raw text, status, words the message must contain)
    ("completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": [1, 2], "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"prompt": [1, 2], "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": [1, 2], "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": [1, 2], "n": 0}, 400, "n must be an int in [1, 128]"),
    ("completions", {"prompt": [1, 2], "n": 10**9}, 400, "n must be an int in [1, 128]"),
    ("completions", '{"prompt": [1, 2], "max_tokens": ', 400, "not valid JSON"),
    ("completions", "[1, 2]", 400, "JSON object"),
    ("completions", {"prompt": [1, 2], "max_tokens": 1.5}, 400, "max_tokens"),
    ("completions", {"prompt": [1, True]}, 400, "prompt"),
    ("completions", {"prompt": [7] * 600}, 400, "maximum context length is 512"),
    ("completions", {"prompt": [7] * 500, "max_tokens": 20}, 400, "500 in the prompt, 20 in the completion"),
    ("completions", {"prompt": [1, 256]}, 400, "[0, 256)"),
    ("completions", {"prompt": [[1, 2], [-1]]}, 400, "[0, 256)"),
    ("completions", {"prompt": []}, 400, "empty"),
    ("completions", {"prompt": "text"}, 400, "no tokenizer"),
    ("completions", {"prompt": [1, 2], "stop": "x"}, 400, "stop strings need a tokenizer"),
    ("completions", {"prompt": [1, 2], "logprobs": 21}, 400, "logprobs must be None or an int in [0, 20]"),
    ("completions", {"prompt": [1, 2], "logit_bias": {"256": 5}}, 400, "logit_bias: token ids must be in [0, 256)"),
    ("completions", {"prompt": [1, 2], "logit_bias": {"one": 5}}, 400, "logit_bias: keys must be token ids"),
    ("completions", {"prompt": [1, 2], "logit_bias": {"1": 101}}, 400, "logit_bias must map"),
    ("completions", {"prompt": [1, 2], "presence_penalty": 2.5}, 400, "presence_penalty must be"),
    ("completions", {"prompt": [1, 2], "repetition_penalty": 0}, 400, "repetition_penalty must be"),
    ("completions", {"prompt": [1, 2], "best_of": 2}, 400, "best_of is not supported"),
    ("completions", {"prompt": [1, 2], "min_p": 1.5}, 400, "min_p must be"),
    ("completions", {"prompt": [1, 2], "min_q": 0.1}, 400, "unknown field 'min_q'"),
    ("completions", {"prompt": [1, 2], "stream": True,
                     "stream_options": {"include_usage": True, "chunk_size": 4}}, 400,
     "unknown field 'stream_options.chunk_size'"),
    ("completions", {"prompt": [1, 2], "max_tokens": 3, "min_tokens": 5}, 400, "min_tokens must be"),
    ("completions", {"prompt": [1, 2], "stream_options": {"include_usage": True}}, 400, "stream=true"),
    ("completions", {"model": "gpt-4", "prompt": [1, 2]}, 404, "gpt-4"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "chat template"),
]


@pytest.mark.parametrize("endpoint, body, status, words", BAD_INPUTS,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_gets_a_clear_error_and_nothing_is_queued(exact_server, endpoint, body, status, words):
    before = scrape(exact_server)
    url = f"{exact_server.base_url}/{endpoint}"
    response = (httpx.post(url, content=body, headers={"content-type": "application/json"})
                if isinstance(body, str) else httpx.post(url, json=body))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == status
    assert words in error["message"], error["message"]
    assert "Traceback" not in response.text
    after = scrape(exact_server)
    assert after["minillm:prompt_tokens_total"] == before["minillm:prompt_tokens_total"]
    assert finished_requests(after) == finished_requests(before)
    assert after["minillm:num_requests_waiting"] == 0


def test_unknown_fields_are_refused_by_name_counted_and_logged(exact_server):
    """minillm refuses a field it does not know (vLLM would log it and drop it); null counts as
    absent and OpenAI's no-effect fields (user, metadata, ...) are taken. Each refusal is counted
    by reason in /metrics and written to the log with it."""
    client = client_for(exact_server)
    before = rejected(exact_server)
    with pytest.raises(openai.BadRequestError, match="unknown field 'typical_p'") as caught:
        client.completions.create(model="tiny-exact", prompt=[1, 2], max_tokens=2,
                                  extra_body={"typical_p": 0.9})
    assert caught.value.body["param"] == "typical_p"
    answer = client.completions.create(model="tiny-exact", prompt=[1, 2], max_tokens=2, user="u1",
                                       extra_body={"typical_p": None, "ignore_eos": True,
                                                                   "best_of": 1, "echo": False})
    assert answer.usage.completion_tokens == 2
    after = rejected(exact_server)
    assert after["unknown_field"] - before.get("unknown_field", 0) == 1
    assert "400 unknown_field (typical_p)" in exact_server.log()


def test_errors_name_the_parameter_the_client_sent(chat_server):
    client = client_for(chat_server)
    messages = [{"role": "user", "content": "Hello"}]
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens must be") as caught:
        client.chat.completions.create(model="tiny-chat", messages=messages, max_completion_tokens=0)
    assert caught.value.body["param"] == "max_completion_tokens"
    assert "max_tokens" not in caught.value.body["message"].replace("max_completion_tokens", "")
    with pytest.raises(openai.BadRequestError, match="reduce the prompt or max_completion_tokens"):
        client.chat.completions.create(model="tiny-chat", messages=messages,
                                       max_completion_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="reduce the prompt or max_tokens"):
        client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=1000)


def test_openai_client_raises_its_own_error_types(exact_server):
    client = client_for(exact_server)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny-exact", prompt=[1, 2], max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=[1, 2])
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="tiny-exact", messages=[{"role": "user", "content": "hi"}])


# --- concurrency, hang-ups, the queue, shutdown ---------------------------------------------------

def exact_prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (int(n),), generator=generator).tolist()
            for n in torch.randint(4, 60, (count,), generator=generator)]


def test_concurrent_streams_equal_the_same_requests_served_alone(exact_server):
    prompts = exact_prompts(24)
    max_tokens = [8 + i % 9 for i in range(24)]
    extra = {"return_token_ids": True, "ignore_eos": True}
    client = client_for(exact_server)
    alone = [client.completions.create(model="tiny-exact", prompt=p, max_tokens=m, temperature=0,
                                       extra_body=extra).choices[0].token_ids
             for p, m in zip(prompts, max_tokens)]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=exact_server.base_url, api_key="none", max_retries=0)

        async def stream(prompt, m):
            chunks = await aclient.completions.create(model="tiny-exact", prompt=prompt, max_tokens=m,
                                                      temperature=0, stream=True, extra_body=extra)
            return [t async for c in chunks for t in c.choices[0].token_ids]
        return await asyncio.gather(*(stream(p, m) for p, m in zip(prompts, max_tokens)))

    assert asyncio.run(together()) == alone
    assert [len(a) for a in alone] == max_tokens
    wait_until_idle(exact_server)


def test_a_client_that_hangs_up_frees_its_kv_blocks_within_a_second(exact_server):
    body = {"prompt": exact_prompts(1)[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    before = scrape(exact_server)
    with httpx.stream("POST", exact_server.base_url + "/completions", json=body) as response:
        lines = response.iter_lines()
        assert sum(line.startswith("data:") for line, _ in zip(lines, range(10))) >= 3
        assert scrape(exact_server)["minillm:kv_cache_usage_perc"] > 0
    after = wait_until_idle(exact_server, within=1.0)
    assert finished_requests(after) - finished_requests(before) == 1
    assert after["minillm:request_success_total"] > 0

    with pytest.raises(httpx.ReadTimeout):  # a gathered answer: the client gives up waiting
        httpx.post(exact_server.base_url + "/completions", timeout=0.25,
                   json={**body, "stream": False, "max_tokens": 440})
    wait_until_idle(exact_server, within=1.5)


def test_soak_loses_no_request_and_leaks_no_block(exact_server):
    workload = loadgen.serving_workload("poisson", 256, num_requests=240, input_len=24,
                                        output_len=12, rate=400.0, seed=1)
    before = scrape(exact_server)
    record = loadgen.run_load(exact_server.url, workload, hangup_share=0.25, progress=False, seed=1)
    after = wait_until_idle(exact_server, within=2.0)
    summary, requests = record["summary"], record["requests"]
    assert summary["num_errors"] == 0 and summary["num_aborted"] == 0
    assert summary["num_completed"] + summary["num_hung_up"] == 240
    assert 20 < summary["num_hung_up"] < 100
    for request, wanted in zip(requests, workload.output_lens):
        if not request["hung_up"]:
            assert (request["finish_reason"], request["num_output_tokens"]) == ("length", wanted)
            assert request["tpot"] <= request["max_itl"] < request["e2e"]  # worst gap >= mean gap
    assert finished_requests(after) - finished_requests(before) == 240  # every request ended
    delta = record["server_metrics"]["delta"]
    assert delta["request_success_total.length"] >= summary["num_completed"]
    assert delta["request_success_total.abort"] <= summary["num_hung_up"]
    diagnosis = diagnose_client(record)
    assert diagnosis.latency.num_requests == 240 and diagnosis.symptom in ("first_token", "tokens")
    assert "cannot tell" in diagnosis.report()


def test_loadgen_and_diagnose_command_lines(exact_server, tmp_path, capsys):
    from minillm.__main__ import main

    out = tmp_path / "run.json"
    assert main(["loadgen", "--url", exact_server.url, "--workload", "burst", "--num-requests", "6",
                 "--input-len", "16", "--output-len", "4", "--vocab-size", "256", "--no-progress",
                 "--out", str(out)]) == 0
    assert "completed 6" in capsys.readouterr().out
    assert records.load_record(out)["format"] == records.CLIENT_RUN_FORMAT
    assert main(["diagnose", str(out)]) == 0
    report = capsys.readouterr().out
    assert "1. Which kind of slow" in report and "What a client-side record cannot tell" in report
    assert main(["loadgen", "--url", exact_server.url, "--workload", "twenty-colleagues",
                 "--vocab-size", "256", "--no-progress", "--out", str(out)]) == 2
    assert "max_model_len is 512" in capsys.readouterr().err


def test_a_full_queue_answers_503_and_sigterm_exits_cleanly():
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}

    async def scenario(server):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            async def stream(events: list):
                async with client.stream("POST", "/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            events.append(line[len("data:"):].strip())

            running, waiting = [], []
            tasks = [asyncio.ensure_future(stream(running))]
            while not running:
                await asyncio.sleep(0.02)
            tasks.append(asyncio.ensure_future(stream(waiting)))
            while scrape(server)["minillm:num_requests_waiting"] != 1:
                await asyncio.sleep(0.02)
            full = await client.post("/completions", json={**body, "stream": False})
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert "max_queue=1" in full.json()["error"]["message"]
            exit_code = await asyncio.to_thread(server.stop, 30)
            await asyncio.gather(*tasks)
            return exit_code, running, waiting

    with serve_in_background("tiny", weights="random", num_kv_blocks=64, max_num_seqs=1,
                             max_queue=1, shutdown_timeout=1) as server:
        exit_code, running, waiting = asyncio.run(scenario(server))
        log = server.log()
    assert exit_code == 0
    for events in (running, waiting):
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert re.search(r"0 requests finished in flight, 2 aborted", log), log[-2000:]
    assert "Traceback" not in log


def test_bench_serve_prints_both_comparisons(tmp_path, capsys):
    from minillm.__main__ import main

    (tmp_path / "config.json").write_text(json.dumps(EXACT_CONFIG))
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--model", str(tmp_path), "--device", "cpu", "--num-requests", "4",
                 "--input-len", "16", "--output-len", "4", "--latency-requests", "3",
                 "--repeats", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"output tok/s, 4 at once .* x\d\.\d{3}", printed)
    assert re.search(r"median TTFT, 3 x 1 alone, paired .* [+-][\d.]+ ms median of pairs", printed)
    results = json.loads(out.read_text())["results"]
    assert results["throughput_ratio"] > 0 and len(results["runs"]["ttft_pairs"]) == 3
    for pair in results["runs"]["ttft_pairs"]:  # the client waits at least as long as the engine works
        assert 0 < pair["engine_s"] < pair["server_s"] and pair["offline_s"] > 0


def test_spec_decode_metrics_count_accepted_tokens_by_position(tmp_path):
    """A server drafting with the first of its two layers: /metrics has vLLM's per-position
    counter, one series per proposal position, never growing along the positions, adding up to
    the accepted tokens; a greedy answer is the one the server without speculation gives."""
    (tmp_path / "config.json").write_text(json.dumps(EXACT_CONFIG))
    spec = {"method": "draft_layers", "num_draft_layers": 1, "num_speculative_tokens": 3}
    prompt = [5, 9, 2, 7, 1, 3] * 5
    answers = []
    for speculative_config in (None, json.dumps(spec)):
        with serve_in_background(tmp_path, served_model_name="tiny-exact", weights="random", dtype="float64",
                                 num_kv_blocks=64, block_size=4, speculative_config=speculative_config) as server:
            answers.append(client_for(server).completions.create(
                model="tiny-exact", prompt=prompt, max_tokens=32, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].token_ids)
            text = httpx.get(server.url + "/metrics").text
    per_pos = {s.labels["position"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "minillm:spec_decode_num_accepted_tokens_per_pos_total"}
    totals = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert answers[0] == answers[1] and len(answers[0]) == 32
    assert list(per_pos) == ["0", "1", "2"] and list(per_pos.values()) == sorted(per_pos.values(), reverse=True)
    assert sum(per_pos.values()) == totals["minillm:spec_decode_num_accepted_tokens_total"] > 0
    assert per_pos["0"] <= totals["minillm:spec_decode_num_drafts_total"]
