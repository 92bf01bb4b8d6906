"""Structured output through xgrammar on the real SmolLM2-135M-Instruct: the same prompts that greedy
decoding answers with prose or broken JSON come back as JSON that parses and validates against the
schema, greedy and sampled, next to a plain request the grammar leaves alone; bad schemas and
settings the grammar cannot honour are refused before anything is queued; matchers and KV blocks
are freed however a request ends; the official ``openai`` client gets JSON from the server
(``response_format`` json_schema and json_object, chat and completions, streamed too, and its
``parse`` helper), and a bad schema gets a 400; ``bench structured`` prints the mask's cost beside
the decode step's."""
import json
import re

import jsonschema
import openai
import pydantic
import pytest

from minillm import LLM, SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "city", "languages"], "additionalProperties": False}
PERSON_CHAT = [{"role": "user", "content": "Describe a fictional programmer as JSON with name, age, city "
                                           "and languages."}]
CAPITAL_CHAT = [{"role": "user", "content": "Give me a JSON object with the name and the population of "
                                            "France's capital."}]


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@pytest.fixture(scope="module")
def llm(one_thread):
    return LLM("smollm2-135m", device="cpu", num_kv_blocks=128)


def check_all_freed(llm: LLM) -> None:
    assert llm.runner.structured.matchers == {}
    assert llm.kv_cache.manager.num_free_blocks == llm.kv_cache.manager.num_blocks


def test_greedy_json_where_the_model_alone_writes_prose_or_broken_json(llm):
    """Both prompts in one batch with a plain request beside them: the mask touches only the
    structured rows, so the plain answer is the one it gets alone."""
    greedy = dict(temperature=0.0, max_tokens=80)
    plain = llm.chat([PERSON_CHAT, CAPITAL_CHAT], SamplingParams(**greedy), use_tqdm=False)
    assert not any(parses(o.text) for o in plain)  # prose, a ```json fence, a trailing comma

    schema = SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(json=PERSON))
    any_object = SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(json_object=True))
    person, capital, alone = llm.chat([PERSON_CHAT, CAPITAL_CHAT, PERSON_CHAT],
                                      [schema, any_object, SamplingParams(**greedy)], use_tqdm=False)
    assert person.finish_reason == capital.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)
    assert isinstance(json.loads(capital.text), dict)
    assert alone.token_ids == plain[0].token_ids
    check_all_freed(llm)


def test_sampled_json_validates_for_every_seed(llm):
    outputs = llm.chat([PERSON_CHAT] * 3, [
        SamplingParams(temperature=1.0, max_tokens=96, seed=seed,
                       structured_outputs=StructuredOutputsParams(json=json.dumps(PERSON)))
        for seed in range(3)], use_tqdm=False)
    assert len({o.text for o in outputs}) == 3  # three different draws
    for output in outputs:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), PERSON)
    check_all_freed(llm)


def test_an_aborted_request_frees_its_matcher(llm):
    params = SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams(json_object=True))
    llm.add_request("cut", llm.chat_prompt_ids(CAPITAL_CHAT), params)
    for _ in range(3):
        llm.step()
    assert list(llm.runner.structured.matchers) == ["cut"]
    llm.abort("cut")
    assert [o.finish_reason for o in llm.step()] == ["abort"]
    check_all_freed(llm)


def test_a_refused_request_leaves_no_matcher_and_keeps_the_live_ones(llm):
    """Admission (the scheduler's) comes before the matcher: a structured request refused for its
    length leaves none, and one refused for a duplicate id leaves the live request's matcher as it is."""
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.add_request("long", [1] * llm.config.max_model_len, params)
    check_all_freed(llm)
    llm.add_request("live", llm.chat_prompt_ids(CAPITAL_CHAT), params)
    llm.step()
    matcher = llm.runner.structured.matchers["live"]
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request("live", [1, 2, 3], params)
    assert llm.runner.structured.matchers == {"live": matcher}
    while llm.has_unfinished():
        outputs = llm.step()
    assert outputs[-1].finish_reason == "stop" and parses(outputs[-1].text)
    check_all_freed(llm)


@pytest.mark.parametrize("schema, message", [
    ({"type": "foo"}, 'Unsupported type "foo"'),
    ({"type": "object", "required": "name"}, "required must be an array"),
    ('{"type": ', "Failed to parse JSON"),
    ({"$ref": "#/definitions/missing"}, "missing"),
])
def test_a_bad_schema_is_refused_before_anything_is_queued(llm, schema, message):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match="invalid JSON schema: .*" + message):
        llm.add_request("bad", [1, 2, 3], params)
    assert not llm.has_unfinished()
    check_all_freed(llm)


def test_settings_the_grammar_cannot_honour_are_refused():
    with pytest.raises(ValueError, match="exactly one of json"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of json"):
        StructuredOutputsParams(json={}, json_object=True)
    with pytest.raises(ValueError, match="json must be a JSON schema"):
        StructuredOutputsParams(json=["not", "a", "schema"])
    json_object = StructuredOutputsParams(json_object=True)
    with pytest.raises(ValueError, match="^ignore_eos cannot be combined with structured outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=json_object)
    with pytest.raises(ValueError, match="^min_tokens cannot be combined with structured outputs"):
        SamplingParams(min_tokens=2, structured_outputs=json_object)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json_object": True})


def test_speculative_decoding_refuses_structured_requests_clearly(llm):
    spec = LLM(llm.model, num_kv_blocks=32, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(ValueError, match="cannot be combined with speculative decoding"):
        spec.add_request("spec", [1, 2, 3], params)
    assert not spec.has_unfinished() and spec.runner.structured.matchers == {}


# --- the server, with the official client ----------------------------------------------------------

class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int
    city: str = pydantic.Field(max_length=24)


@pytest.fixture(scope="module")
def client(smollm_server):
    return openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="unused", max_retries=0)


def test_the_openai_client_gets_json_for_a_schema_and_for_json_object(client):
    person_format = {"type": "json_schema",
                     "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = client.chat.completions.create(model="smol", messages=PERSON_CHAT, temperature=0,
                                          max_tokens=80, response_format=person_format)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)

    parsed = client.chat.completions.parse(model="smol", messages=PERSON_CHAT, temperature=0,
                                           max_tokens=80, response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)

    stream = client.chat.completions.create(model="smol", messages=CAPITAL_CHAT, temperature=0,
                                            max_tokens=80, stream=True,
                                            response_format={"type": "json_object"})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)

    prompt = "A JSON object describing a cat, with its name and age:\n"
    completion = client.completions.create(model="smol", prompt=prompt, temperature=0, max_tokens=60,
                                           extra_body={"response_format": {"type": "json_object"}})
    plain = client.completions.create(model="smol", prompt=prompt, temperature=0, max_tokens=60)
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].text), dict)
    assert not parses(plain.choices[0].text)

    text_format = client.chat.completions.create(model="smol", messages=CAPITAL_CHAT, temperature=0,
                                                 max_tokens=8, response_format={"type": "text"})
    assert text_format.choices[0].message.content


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
     'invalid JSON schema: Unsupported type "foo"'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}},
     "invalid JSON schema: properties must be an object"),
    ({"type": "json_schema"}, "json_schema .* goes with, and only with, type 'json_schema'"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "goes with, and only with"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
])
def test_a_bad_response_format_is_a_400_before_anything_is_queued(client, response_format, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smol", messages=CAPITAL_CHAT, max_tokens=4,
                                       response_format=response_format)
    assert err.value.status_code == 400
    assert err.value.body["param"].startswith("response_format")
    assert re.search(message, err.value.body["message"])


def test_bench_structured_prints_the_mask_beside_the_decode_step(capsys):
    from minillm.__main__ import main
    from minillm.lab.bench_structured import format_structured

    assert main(["bench", "structured", "--device", "cpu", "--batch", "2", "--steps", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["batch"], result["steps"], result["cpu_threads"]) == (2, 3, 1)
    assert result["mask_s"] == result["fill_s"] + result["apply_s"]
    assert result["mask_share"] == result["mask_s"] / result["decode_step_s"]
    assert 0 < result["mask_s"] < result["structured_step_s"]
    text = format_structured(result)
    for line in (f"decode step (plain): {result['decode_step_s'] * 1e3:.3f} ms",
                 f"decode step (structured, mask inside): {result['structured_step_s'] * 1e3:.3f} ms",
                 f"mask (fill + apply): {result['mask_s'] * 1e3:.3f} ms",
                 f"mask / decode step: {result['mask_share']:.2%}"):
        assert line in text
