"""A tool call's argument schema is closed where it says nothing of other keys (``closed_objects``): a constrained
model cannot go on inventing keys, and what it writes still validates against the schema as given."""

from __future__ import annotations

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixcache.engine.grammar import closed_objects

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "stops": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": True},
    },
    "$defs": {"point": {"properties": {"x": {"type": "number"}}}},
    "anyOf": [{"properties": {"city": {"type": "string"}}}],
}
COMPOSED = [
    {
        "allOf": [
            {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]},
        ]
    },
    {
        "type": "object",
        "$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
        "allOf": [{"$ref": "#/$defs/base"}],
        "properties": {"title": {"type": "string"}},
        "required": ["title"],
    },
    {
        "type": "object",
        "$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
        "properties": {"item": {"$ref": "#/$defs/base", "properties": {"title": {"type": "string"}}}},
    },
]


def test_every_object_that_names_properties_is_closed_and_an_explicit_choice_is_kept() -> None:
    closed = closed_objects(WEATHER)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["where"]["additionalProperties"] is False
    assert closed["properties"]["stops"]["items"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["$defs"]["point"]
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["city"]


def test_the_given_schema_is_not_changed_and_a_schema_without_properties_stays_open() -> None:
    before = repr(WEATHER)
    closed_objects(WEATHER)
    assert repr(WEATHER) == before
    assert closed_objects({"type": "object"}) == {"type": "object"}
    assert closed_objects(True) is True


@given(
    st.dictionaries(st.sampled_from(["city", "unit", "days"]), st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(min_size=1, max_size=4), st.integers(), max_size=2),
)
def test_what_the_closed_schema_accepts_the_given_schema_accepts(known: dict, other: dict) -> None:
    schema = {"type": "object", "properties": {k: {"type": "string"} for k in ("city", "unit", "days")}}
    value = {**other, **known}
    closed_valid = jsonschema.Draft202012Validator(closed_objects(schema)).is_valid(value)
    assert not closed_valid or jsonschema.Draft202012Validator(schema).is_valid(value)
    assert closed_valid == (set(value) <= {"city", "unit", "days"})


@pytest.mark.parametrize("schema", COMPOSED, ids=["allOf", "allOf-ref-and-properties", "ref-beside-properties"])
def test_composed_objects_stay_open_so_each_parts_keys_remain_allowed(schema: dict) -> None:
    closed = closed_objects(schema)
    value = {"name": "a", "email": "b"} if "allOf" in schema and "$defs" not in schema else {"id": 1, "title": "t"}
    if "item" in schema.get("properties", {}):
        value = {"item": {"id": 1, "title": "t"}}
    assert jsonschema.Draft202012Validator(schema).is_valid(value)
    assert jsonschema.Draft202012Validator(closed).is_valid(value)
