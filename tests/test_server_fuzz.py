"""Generated bodies against a running server (issue 31): whatever a client sends (wrong types,
values out of range, nulls, NaN and infinities, unicode with lone surrogates, long text, bodies
that are no object at all) to any POST route, the answer is a 2xx or a 4xx with OpenAI's error
body and a message (a stream ends with ``data: [DONE]`` and no server error), the server stays
healthy, a normal request succeeds after each one, and no request is left holding a KV block.
Derandomized, so CI runs the same examples every time."""
import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_server import save_chat_model, wait_until_idle

from minillm.server.launcher import serve_in_background

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
EDGE_INTS = [0, -1, 2**31, 2**63, 2**64, -2**63, 2**100]
EDGE_FLOATS = [0.0, -0.0, 1e-40, 1e-300, 5e-324, 1e308, math.nan, math.inf, -math.inf]

EDGE_TEXTS = ["", "\ud800", "a\udfffb", "\x00", "e\u0301", "<|assistant|>", "</s>", "😀" * 8]

texts = st.one_of(st.sampled_from(EDGE_TEXTS), st.text(max_size=30),
                  st.integers(0, 4000).map(lambda n: "xy " * n))
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-5, 300))
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(-3, 3))
token_ids = st.lists(st.one_of(st.integers(0, 420), st.sampled_from(EDGE_INTS)), max_size=40)
anything = st.recursive(st.one_of(st.none(), st.booleans(), ints, floats, texts),
                        lambda inner: st.lists(inner, max_size=4) |
                        st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", ""])},
    optional={"content": st.one_of(st.none(), texts, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])}, optional={"text": texts}), max_size=3)),
              "name": texts}), max_size=4)
FIELDS = {  # each field: a plausible value or anything at all
    "model": st.sampled_from(["tiny-fuzz", "gpt-4", ""]),
    "prompt": st.one_of(texts, token_ids, st.lists(texts, max_size=4),
                        st.lists(token_ids, max_size=4)),
    "messages": messages, "tokens": token_ids,
    "max_tokens": ints, "max_completion_tokens": ints, "min_tokens": ints, "n": ints, "seed": ints,
    "top_k": ints, "temperature": floats, "top_p": floats,
    "stop": st.one_of(texts, st.lists(texts, max_size=3)), "stop_token_ids": token_ids,
    "stream": st.booleans(), "ignore_eos": st.booleans(), "return_token_ids": st.booleans(),
    "add_generation_prompt": st.booleans(), "add_special_tokens": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {}]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function"}]),
    "user": texts, "metadata": anything, "logprobs": anything, "typo_field": anything,
}
BASES = {  # a request each route serves, for the generated fields to change
    "/v1/completions": {"prompt": "Hello", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [5, 6]},
}
SAMPLING = ("max_tokens", "min_tokens", "n", "seed", "top_k", "temperature", "top_p", "stop",
            "stop_token_ids", "prompt", "messages")  # drawn three times as often
changes = st.lists(st.sampled_from(list(FIELDS) + 2 * list(SAMPLING)), min_size=1, max_size=3,
                   unique=True).flatmap(lambda names: st.fixed_dictionaries(
                       {name: st.one_of(FIELDS[name], FIELDS[name], anything) for name in names}))
ISSUE = [{"seed": 2**64}, {"temperature": 1e-40}, {"top_p": 1e-50}, {"top_k": 2**63},
         {"prompt": "a\ud800"}, {"temperature": None, "top_p": None, "n": None, "stream": None},
         {"response_format": {"type": "text"}, "tool_choice": "none", "reasoning_effort": "low"},
         {"tool_choice": "required"}, {"prompt": ["Hello"] * 9}]  # the issue's requests


@st.composite
def requests(draw):
    """(route, body): mostly a served request with one to three fields changed, sometimes any
    set of fields, sometimes a body that is not an object at all."""
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["changed"] * 6 + ["fields", "anything"]))
    if kind == "changed":
        return route, {**BASES[route], **draw(changes)}
    if kind == "fields":
        return route, draw(st.fixed_dictionaries({}, optional=FIELDS))
    return route, draw(anything)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """A tiny chat model (a trained tokenizer and a chat template), short contexts: a generated
    request that is accepted generates at most 64 tokens."""
    folder = tmp_path_factory.mktemp("fuzz-model")
    save_chat_model(folder)
    with serve_in_background(folder, served_model_name="tiny-fuzz", num_kv_blocks=64,
                             block_size=8, max_model_len=64, max_queue=8) as server:
        yield server


def check_answer(response: httpx.Response) -> None:
    """2xx (a stream ending in [DONE] without a server error) or 4xx with a message."""
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], response.text[:500]
        assert error["code"] == response.status_code
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            assert json.loads(event).get("error", {}).get("code", 200) < 500, event
    else:
        assert isinstance(response.json(), dict)


def test_generated_bodies_get_a_2xx_or_a_4xx_and_the_server_keeps_serving(fuzz_server):
    normal = {"model": "tiny-fuzz", "prompt": "Hello", "max_tokens": 2, "temperature": 0,
              "ignore_eos": True}
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as client:

        @settings(max_examples=200, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(request=requests())
        @_issue_examples
        def one(request):
            route, body = request
            content = json.dumps(body)  # NaN and Infinity too: Python's json reads them back
            check_answer(client.post(route, content=content,
                                     headers={"content-type": "application/json"}))
            after = client.post("/v1/completions", json=normal)
            assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2

        one()
        assert client.get("/health").status_code == 200
    wait_until_idle(fuzz_server, within=5)


def _issue_examples(test):
    """The issue's requests, tried before the generated ones."""
    for route in ("/v1/completions", "/v1/chat/completions"):
        for change in ISSUE:
            test = example(request=(route, {**BASES[route], **change}))(test)
    return test
