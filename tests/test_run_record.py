"""``core/decode/run_record``: the ``onnx-prep run`` record as a library call (the CLI's
tests drive the same function through ``onnx-prep run``)."""
from __future__ import annotations

import json
from importlib import resources

import pytest

from conftest import ort_or_skip
from onnx_prep.core.decode.run_record import SCHEMA, RunOptions, record_run
from onnx_prep.core.errors import UsageError


def test_the_record_of_an_ort_run_validates_against_the_schema(small_llm_path):
    ort_or_skip()
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(resources.files("onnx_prep.core").joinpath("schemas/run.schema.json").read_text())
    doc = record_run(small_llm_path, RunOptions(prompt_ids=((5, 6, 7),) * 2, tokens=3, runtime="ort"))
    jsonschema.validate(doc, schema)
    assert doc["schema"] == SCHEMA == schema["$id"]
    assert doc["prompt_ids"] == [[5, 6, 7]] * 2 and len(doc["tokens"]) == 2 and len(doc["tokens"][0]) == 3
    assert doc["source_pages"] is None and doc["compare"] is None


@pytest.mark.parametrize("kw, match", [
    (dict(runtime="tvm"), "--runtime must be one of"),
    (dict(compare="tvm"), "--compare supports only 'ort'"),
    (dict(runtime="ort", compare="ort"), "with itself"),
    (dict(tokens=0), "--tokens must be at least 1"),
    (dict(threads=0), "--threads must be at least 1"),
    (dict(prompt_ids=((1, 2), (3,))), "same length"),
    (dict(prompt_ids=((1, -2),)), "non-negative"),
    (dict(prompt_ids=()), "non-empty"),
    (dict(source_pages="sometimes"), "--source-pages must be one of"),
])
def test_options_are_checked_on_construction(kw, match):
    with pytest.raises(UsageError, match=match):
        RunOptions(**kw)
