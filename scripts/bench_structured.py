"""Structured output on the real engine (the embedded 270M unless --model says
otherwise), with kvd's scheduler and llguidance:

1. grammar compile time per JSON schema, first use and cached (the
   vocabulary's one-time build apart);
2. whether every output under a dozen varied schemas parses and validates
   (``jsonschema``), greedy, from a chat prompt asking for it. Free-length
   strings and numbers carry bounds (maxLength, maximum), as they should for
   a small model: greedy, the 270M can repeat a digit until max_tokens cuts
   the JSON short (measured: 3 of 12 without them);
3. the decode step time of a 32-row batch with 8 constrained rows against
   the same batch with none, alternated in one run.

    .venv/bin/python scripts/bench_structured.py [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jsonschema

from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import load_model
from kvd.engine.tokenizer import ChatMessage
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.scheduler import Scheduler, TenantConfig
from kvd.server.grammar import Grammar, GrammarCompiler

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a person with a name and an age",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "age"],
        },
    ),
    (
        "the capital of France",
        {
            "type": "object",
            "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
            "required": ["country", "capital"],
            "additionalProperties": False,
        },
    ),
    (
        "three primary colors",
        {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3},
    ),
    (
        "whether the sky is blue",
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    ),
    (
        "a book: title, author, year and genres",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "author": {"type": "string"},
                "year": {"type": "integer", "minimum": 0, "maximum": 2100},
                "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            },
            "required": ["title", "author", "year", "genres"],
            "additionalProperties": False,
        },
    ),
    (
        "the weather today",
        {
            "type": "object",
            "properties": {
                "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                "temperature_c": {"type": "number"},
            },
            "required": ["condition", "temperature_c"],
        },
    ),
    (
        "an address",
        {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string"},
            },
            "required": ["street", "city", "postal_code", "country"],
        },
    ),
    (
        "a meeting: a date and a list of attendees",
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "format": "date"},
                "attendees": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "email": {
                                "type": "string",
                                "pattern": "^[a-z0-9.]{1,20}@[a-z]{1,12}\\.[a-z]{2,3}$",
                            },
                        },
                        "required": ["name"],
                        "additionalProperties": False,
                    },
                    "maxItems": 3,
                },
            },
            "required": ["date", "attendees"],
        },
    ),
    (
        "a product with a price",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"type": "number", "minimum": 0},
                "currency": {"enum": ["EUR", "USD", "GBP"]},
                "in_stock": {"type": "boolean"},
            },
            "required": ["sku", "price", "currency", "in_stock"],
            "additionalProperties": False,
        },
    ),
    ("a number between 1 and 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    (
        "a to-do item, or nothing",
        {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"task": {"type": "string"}, "done": {"type": "boolean"}},
                    "required": ["task", "done"],
                },
            ]
        },
    ),
    (
        "a tree: a node with a value and up to two children",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer"},
                        "children": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/node"},
                            "maxItems": 2,
                        },
                    },
                    "required": ["value"],
                }
            },
            "$ref": "#/$defs/node",
        },
    ),
]


def compile_times(compiler: GrammarCompiler) -> None:
    started = time.perf_counter()
    compiler.constraint(Grammar("json", "{}", "warm"))  # the vocabulary's build
    print(f"vocabulary build (once a process): {time.perf_counter() - started:.2f} s")
    first: list[float] = []
    cached: list[float] = []
    for _, schema in SCHEMAS:
        grammar = Grammar("json", json.dumps(schema), "bench")
        for into in (first, cached):
            started = time.perf_counter()
            compiler.constraint(grammar)
            into.append(time.perf_counter() - started)
    print(
        f"compile, first use: median {1e3 * statistics.median(first):.2f} ms, "
        f"max {1e3 * max(first):.2f} ms; cached: median {1e6 * statistics.median(cached):.0f} us"
    )


def validity(engine: Engine, compiler: GrammarCompiler, max_tokens: int) -> None:
    tokenizer = engine.model.tokenizer
    assert tokenizer is not None
    scheduler = Scheduler(engine)
    scheduler.set_tenant(TenantConfig("t"))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for i, (ask, schema) in enumerate(SCHEMAS):
        prompt = tokenizer.chat_prompt(
            [ChatMessage("user", f"Give {ask}, as JSON matching this schema: {json.dumps(schema)}")]
        )
        constraint = compiler.constraint(Grammar("json", json.dumps(schema), "bench"))
        scheduler.submit(f"r{i}", "t", prompt, params, constraint=constraint)
        outputs[f"r{i}"] = []
    while scheduler.has_work():
        for event in scheduler.step().events:
            if event.token is not None:
                outputs[event.request_id].append(event.token)
            if event.finished:
                finish[event.request_id] = event.finish_reason or "?"
    valid = 0
    for i, (ask, schema) in enumerate(SCHEMAS):
        text = tokenizer.decode(outputs[f"r{i}"])
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
            verdict = "valid"
        except (ValueError, jsonschema.ValidationError) as exc:
            verdict = f"INVALID ({type(exc).__name__})"
        print(f"  {ask}: {finish[f'r{i}']}, {verdict}: {text[:100]!r}")
    print(f"valid under their schemas: {valid} of {len(SCHEMAS)}")


def step_times(engine: Engine, compiler: GrammarCompiler, rounds: int) -> None:
    """Decode steps of 32 rows, 8 of them constrained or none, alternated."""
    tokenizer = engine.model.tokenizer
    assert tokenizer is not None
    # A grammar that never ends within the run: lower-case words.
    grammar = Grammar("regex", "[a-z]+( [a-z]+)*", "bench")
    times: dict[int, list[float]] = {0: [], 8: []}
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    prompt = tokenizer.encode("Write a long story about a lighthouse keeper:")
    for constrained in (0, 8) * rounds:
        scheduler = Scheduler(engine)
        scheduler.set_tenant(TenantConfig("t"))
        for i in range(32):
            constraint = compiler.constraint(grammar) if i < constrained else None
            scheduler.submit(f"r{i}", "t", [*prompt, 1000 + i], params, constraint=constraint)
        while True:  # every prompt in, every row decoding
            scheduler.step()
            running = list(scheduler.book.running.values())
            if len(running) == 32:
                seqs = [r.seq for r in running if r.seq is not None]
                fields = scheduler.kv.step_columns(scheduler.kv.slots_of(seqs))
                if (fields.length == fields.computed + 1).all():
                    break
        for _ in range(3):
            scheduler.step()
        started = time.perf_counter()
        for _ in range(10):
            scheduler.step()
        times[constrained].append((time.perf_counter() - started) / 10)
        for i in range(32):
            scheduler.cancel(f"r{i}")
    free, masked = statistics.median(times[0]), statistics.median(times[8])
    print(
        f"decode step, 32 rows: none constrained {1e3 * free:.1f} ms, 8 constrained "
        f"{1e3 * masked:.1f} ms ({masked / free:.2f}x), medians of {rounds} rounds of 10 steps"
    )


def main() -> None:
    from kvd.engine import compile_cache

    compile_cache.enable_default()  # a process's entry point enables JAX's cache
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = load_model(args.model)
    assert model.tokenizer is not None
    config = EngineConfig(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512)
    engine = Engine(model, config)
    print(f"warm-up: {engine.warm_up():.1f} s")
    compiler = GrammarCompiler(model.tokenizer, model.config.vocab_size)
    compile_times(compiler)
    validity(engine, compiler, args.max_tokens)
    if args.rounds:
        step_times(engine, compiler, args.rounds)


if __name__ == "__main__":
    main()
