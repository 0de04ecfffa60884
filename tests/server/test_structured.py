"""Structured output through the API in-process: the real app, scheduler and
llguidance on the embedded model's real tokenizer, over the simulated
executor (whose "model" picks the first token the grammar's mask allows from
a pseudo-random one), called with the real OpenAI client. Every output is
checked against its format: JSON against its schema with ``jsonschema``,
regular expressions and choices exactly."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest

from kvd.server.grammar import compiler_for
from tests.server.harness import MODEL, Served, serving, tokenizer
from tests.server.test_api import client, post

# openai's AsyncStream leaves its inner async generators unexhausted after
# [DONE] (trio reports each when collected): the client's wart, as in test_api.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture
async def served(tmp_path: Any) -> AsyncIterator[Served]:
    async with serving(tmp_path) as daemon:
        yield daemon


# Formats a grammar closes by itself (bounded strings, enums, numbers with
# few digits): every output must end "stop", never run to max_tokens.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "boolean"},
    {"type": "integer", "minimum": 0, "maximum": 99},
    {"enum": ["red", "green", "blue"]},
    {"type": "string", "maxLength": 8},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "maximum": 9, "minimum": -9},
                    "y": {"type": "integer", "maximum": 9, "minimum": -9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"enum": ["a", "b"]},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {
        "anyOf": [
            {"type": "null"},
            {"const": "none"},
            {"type": "integer", "minimum": 1, "maximum": 5},
        ]
    },
    {"type": "string", "pattern": "^[a-f0-9]{4}$"},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 2},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    },
    {"type": "string", "format": "date"},
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
            "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.5},
        },
        "required": ["id", "score"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_json_schemas_give_valid_json(served: Served, endpoint: str) -> None:
    """Twelve schemas, each output valid JSON under its schema; greedy and
    sampled, n = 2, and streamed."""
    oai = client(served)
    for i, schema in enumerate(SCHEMAS):
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": f"s{i}", "schema": schema},
        }
        common: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 64,
            "n": 2,
            "temperature": 1.0,
            "seed": i,
        }
        if endpoint == "chat":
            reply = await oai.chat.completions.create(
                **common,
                messages=[{"role": "user", "content": f"Answer in JSON ({i})."}],
                response_format=response_format,  # type: ignore[arg-type]
            )
            texts = [c.message.content or "" for c in reply.choices]
        else:
            reply = await oai.completions.create(  # type: ignore[assignment]
                **common, prompt=f"JSON {i}:", extra_body={"response_format": response_format}
            )
            texts = [c.text for c in reply.choices]  # type: ignore[attr-defined]
        assert [c.finish_reason for c in reply.choices] == ["stop", "stop"], (schema, texts)
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
    await served.assert_whole()


async def test_a_streamed_json_object(served: Served) -> None:
    oai = client(served)
    schema = SCHEMAS[4]
    stream = await oai.completions.create(
        model=MODEL,
        prompt="A person:",
        max_tokens=64,
        stream=True,
        extra_body={"guided_json": schema},
    )
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)
    # json_object: any JSON object.
    reply = await oai.completions.create(
        model=MODEL,
        prompt="{",
        max_tokens=200,
        extra_body={"structured_outputs": {"json_object": True}},
    )
    text = reply.choices[0].text
    assert text.startswith("{")  # unbounded: it may run to max_tokens
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    await served.assert_whole()


async def test_regex_choice_and_lark(served: Served) -> None:
    oai = client(served)
    for seed in range(4):
        common: dict[str, Any] = {
            "model": MODEL,
            "prompt": "code:",
            "max_tokens": 32,
            "temperature": 1.0,
            "seed": seed,
        }
        regex = await oai.completions.create(
            **common, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"}
        )
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.choices[0].text), regex.choices[0].text
        assert regex.choices[0].finish_reason == "stop"
        options = ["yes", "no", 'a "quoted" answer', "naïve"]
        choice = await oai.completions.create(**common, extra_body={"guided_choice": options})
        assert choice.choices[0].text in options
        lark = await oai.completions.create(
            **common,
            extra_body={
                "structured_outputs": {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'}
            },
        )
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", lark.choices[0].text), lark.choices[0].text
    await served.assert_whole()


async def test_a_format_compiles_once(served: Served) -> None:
    """The second request with the same schema takes the cached grammar."""
    grammars = compiler_for(tokenizer(), served.daemon.context.vocab_size)
    schema = {
        "type": "object",
        "properties": {"k": {"enum": [1, 2]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    body = {"model": MODEL, "prompt": "x", "max_tokens": 16, "guided_json": schema}
    compiles, hits = grammars.compiles, grammars.hits
    for _ in range(2):
        status, reply, _ = await post(served, "/v1/completions", body)
        assert status == 200, reply
        assert json.loads(reply["choices"][0]["text"]) in ({"k": 1}, {"k": 2})
    assert (grammars.compiles, grammars.hits) == (compiles + 1, hits + 1)


FORMAT_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"guided_json": {"type": "strin"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                },
            }
        },
        "response_format.json_schema.schema",
    ),
    ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "[0-9]+", "min_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize(("extra", "param"), FORMAT_ERRORS)
async def test_a_bad_format_is_a_400_naming_its_field(
    served: Served, extra: dict[str, Any], param: str
) -> None:
    status, reply, _ = await post(
        served, "/v1/completions", {"model": MODEL, "prompt": "x"} | extra
    )
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    await served.assert_whole()
