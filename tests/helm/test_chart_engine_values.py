"""The chart's named engine values mirror `EngineArgs`: each one's schema, default and effect,
and every other engine argument passes through `engine.extraKwargs`."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from cluster.config import EngineArgs
from tests.helm.test_chart import CHART, _render, _serving_args


def _engine_values_schema() -> dict[str, Any]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    return schema["properties"]["engine"]["properties"]  # type: ignore[no-any-return]


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", camel).lower()


def _as_values_schema(field_schema: dict[str, Any]) -> dict[str, Any]:
    """An `EngineArgs` field's JSON schema in the values schema's shape (one type list; a
    nested config's keys inline)."""
    options = field_schema.get("anyOf", [field_schema])
    ref = next((option["$ref"] for option in options if "$ref" in option), None)
    if ref is not None:
        nested = EngineArgs.model_json_schema()["$defs"][ref.rsplit("/", 1)[-1]]
        return {
            "type": ["object", "null"],
            "description": " ".join(field_schema["description"].split()),
            "properties": {k: _as_values_schema(v) for k, v in nested["properties"].items()},
            "additionalProperties": False,
            "required": nested["required"],
        }
    types = [option["type"] for option in options]
    constraints = {
        key: value
        for option in options
        for key, value in option.items()
        if key not in ("default", "title", "anyOf")
    }
    return {
        **constraints,
        "type": types[0] if len(types) == 1 else types,
        "description": " ".join(field_schema["description"].split()),
    }


NAMED_ENGINE_VALUES = [name for name in _engine_values_schema() if name != "extraKwargs"]


@pytest.mark.parametrize("name", NAMED_ENGINE_VALUES)
def test_named_engine_values_mirror_their_engine_args_field(name: str) -> None:
    field = _snake(name)
    assert field in EngineArgs.model_fields, f"engine.{name} is no EngineArgs field"
    properties = EngineArgs.model_json_schema()["properties"]
    assert _engine_values_schema()[name] == _as_values_schema(properties[field])
    default = yaml.safe_load((CHART / "values.yaml").read_text())["engine"][name]
    assert default == EngineArgs.model_fields[field].default


def test_named_engine_values_reach_their_engine_args_field() -> None:
    values = {"tensorParallelSize": 2, "maxModelLen": 77, "gpuMemoryUtilization": 0.5,
              "enablePrefixCaching": False,
              "speculativeConfig": {"method": "ngram", "num_speculative_tokens": 3}}  # fmt: skip
    assert set(values) == set(NAMED_ENGINE_VALUES)
    rayservice = _render({"engine": values, "worker": {"gpusPerPod": 2}})["RayService"]
    args = _serving_args(rayservice).llm_configs[0].engine_args()
    for name, value in values.items():
        got = getattr(args, _snake(name))
        assert (got.model_dump(exclude_none=True) if name == "speculativeConfig" else got) == value


def _sample(field_schema: dict[str, Any], defs: dict[str, Any]) -> Any:
    """The field's default, or a valid value of its first non-null type (a nested settings
    model: each of its fields sampled)."""
    if field_schema.get("default") is not None:
        return field_schema["default"]
    (option, *_) = [o for o in field_schema.get("anyOf", [field_schema]) if o.get("type") != "null"]
    if "$ref" in option:
        nested = defs[option["$ref"].rsplit("/", 1)[-1]]["properties"]
        return {name: _sample(schema, defs) for name, schema in nested.items()}
    if "enum" in option:
        return option["enum"][0]
    if option["type"] == "array" and option.get("items", {}).get("type") == "integer":
        return [option["items"].get("minimum", 1)]
    return {
        "string": "/x",
        "integer": option.get("minimum", 1),
        "number": option.get("minimum", 1),
        "object": {"image": 1},
        "array": ["x"],
    }[option["type"]]


def test_every_other_engine_argument_passes_through_extra_kwargs() -> None:
    named = {_snake(name) for name in NAMED_ENGINE_VALUES}
    schema_of_args = EngineArgs.model_json_schema()
    properties, defs = schema_of_args["properties"], schema_of_args.get("$defs", {})
    extra = {
        field: _sample(schema, defs)
        for field, schema in properties.items()
        if field not in named and field != "model"  # the model comes from model.source
    }
    rayservice = _render({"engine": {"extraKwargs": extra}})["RayService"]
    (config,) = _serving_args(rayservice).llm_configs
    assert config.engine_args().model_dump(include=set(extra)) == extra
