"""The three schemas and the client of the structured-output check on SmolLM2 (issue 27): used by
tests/serve/test_serve_smollm2_api.py (12 requests per schema) and benchmarks/serving/structured_output.py
(50 per schema, the committed result)."""

from __future__ import annotations

import asyncio
import json

PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
VERDICT = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                            "confident": {"type": "boolean"}},
           "required": ["answer", "confident"], "additionalProperties": False}
COLORS = {"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                                                      "items": {"type": "string", "enum": ["red", "green", "blue"]}}},
          "required": ["colors"], "additionalProperties": False}
SCHEMAS = {"person": (PERSON, "Invent a person. Reply in JSON with their name and age."),
           "verdict": (VERDICT, "Is the sky green? Reply in JSON."),
           "colors": (COLORS, "Name the colours of a traffic light as JSON.")}
MAX_TOKENS = 40


async def ask(url: str, key: str, name: str, n: int):
    """``n`` concurrent requests for schema ``name``: the openai client's ChatCompletion objects."""
    import openai

    schema, question = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600) as c:
        return await asyncio.gather(*(c.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS,
            temperature=1.0, seed=i, response_format=fmt) for i in range(n)))


def valid(answer, schema) -> bool:
    """Ended by the model, parses as JSON, and validates against ``schema`` (jsonschema)."""
    import jsonschema

    if answer.choices[0].finish_reason != "stop":
        return False
    try:
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
