"""200 random JSON schemas (Hypothesis): every completion of a random model constrained by one
parses and validates against it with `jsonschema`.

The schemas are bounded (string lengths, integer ranges, array sizes, at most 6 leaves) so that
a random model ends each document well within `max_tokens`. Hypothesis draws them (a fixed seed:
the same 200 every run) and they run as one batch of one `LLM.generate` call, so the test costs a
few seconds; a failure names its schema and completion.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cluster.llm import LLM
from scheduler.request import SamplingParams
from scheduler.structured_outputs import StructuredOutputsParams
from tests.helpers.byte_model import save_byte_model

NUM_SCHEMAS = 200
NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
SHORT = st.text(alphabet="xyz -", min_size=1, max_size=4)


def leaves() -> st.SearchStrategy[dict[str, Any]]:
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda lo_span: {"type": "integer", "minimum": lo_span[0], "maximum": sum(lo_span)}
    )
    string = st.integers(0, 5).map(lambda n: {"type": "string", "maxLength": n})
    enum = st.lists(st.one_of(SHORT, st.integers(-9, 9)), min_size=1, max_size=3, unique=True)
    return st.one_of(
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        integer,
        string,
        enum.map(lambda values: {"enum": values}),
        SHORT.map(lambda value: {"const": value}),
        st.just({"type": "string", "pattern": "^[a-c]{1,3}$"}),
    )


def objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(fields: dict[str, dict[str, Any]], required: list[bool]) -> dict[str, Any]:
        names = list(fields)
        return {
            "type": "object",
            "properties": fields,
            "required": [n for n, keep in zip(names, required, strict=False) if keep],
            "additionalProperties": False,
        }

    return st.builds(
        build, st.dictionaries(NAMES, children, min_size=1, max_size=3), st.lists(st.booleans())
    )


def composites(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    arrays = st.builds(
        lambda items, most: {"type": "array", "items": items, "maxItems": most},
        children,
        st.integers(0, 2),
    )
    any_of = st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options})
    return st.one_of(objects(children), arrays, any_of)


SCHEMAS = st.recursive(leaves(), composites, max_leaves=6)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    model = save_byte_model(tmp_path_factory.mktemp("byte-model"), seed=1)
    engine = LLM(str(model), block_size=16, kv_cache_memory_bytes=64 << 20, max_num_seqs=256)
    yield engine
    engine.shutdown()


def draw_schemas(count: int) -> list[dict[str, Any]]:
    """`count` distinct schemas drawn by Hypothesis (generation only, derandomized)."""
    drawn: dict[str, dict[str, Any]] = {}

    @settings(
        max_examples=4 * count,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(SCHEMAS)
    def collect(schema: dict[str, Any]) -> None:
        if len(drawn) < count:
            drawn.setdefault(json.dumps(schema, sort_keys=True), schema)

    collect()
    return list(drawn.values())


def test_random_schemas_give_valid_documents(llm: LLM) -> None:
    schemas = draw_schemas(NUM_SCHEMAS)
    assert len(schemas) == NUM_SCHEMAS
    params = [
        SamplingParams(
            temperature=1.0,
            seed=index,
            max_tokens=400,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for index, schema in enumerate(schemas)
    ]
    outputs = llm.generate(["Answer in JSON:"] * len(schemas), params, use_tqdm=False)
    for schema, output in zip(schemas, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        document = json.loads(completion.text, strict=False)  # raw control characters allowed
        jsonschema.validate(document, schema)
