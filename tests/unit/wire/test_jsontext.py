"""The control plane's JSON: orjson's text and the standard library's read alike, both ways."""

from __future__ import annotations

import json
import math

import pytest

from unbroken.wire import jsontext


def test_the_text_is_compact_and_the_standard_library_reads_it_back() -> None:
    msg = {"op": "quorum", "id": 7, "decision": {"epoch": 3, "members": [0, 1, 2]}, "step_time": 0.25, "node": "nœud"}
    text = jsontext.dumps(msg)
    assert b" " not in text  # compact, as json.dumps with separators=(",", ":")
    assert json.loads(text) == msg
    assert jsontext.loads(json.dumps(msg)) == msg


def test_keys_that_are_not_strings_are_written_as_json_writes_them() -> None:
    assert json.loads(jsontext.dumps({1: "a", "b": 2})) == json.loads(json.dumps({1: "a", "b": 2}))


def test_what_orjson_cannot_write_is_still_written() -> None:
    big = {"n": 1 << 70}
    assert json.loads(jsontext.dumps(big)) == big


@pytest.mark.parametrize("text", [b"[1,2", b'{"a":', b"\xff", b""])
def test_a_malformed_text_is_a_value_error(text: bytes) -> None:
    with pytest.raises(ValueError):
        jsontext.loads(text)


def test_a_nan_travels_as_the_standard_library_writes_and_reads_it() -> None:
    # A rank's NaN loss is what the anomaly watch acts on: it must not arrive as null.
    msg = {"op": "telemetry", "losses": [1.5, float("nan")], "worst": {"x": float("inf")}, "failed_epoch": None}
    text = jsontext.dumps(msg)
    assert text == json.dumps(msg, separators=(",", ":")).encode()
    back = jsontext.loads(text)
    assert math.isnan(back["losses"][1]) and back["worst"]["x"] == math.inf and back["failed_epoch"] is None


def test_a_lone_surrogate_reads_as_before() -> None:
    assert jsontext.loads(b'"\\ud800"') == json.loads(b'"\\ud800"')


def test_without_orjson_the_standard_library_writes_and_reads_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a machine without orjson (the GPU image): the same text, the same values.
    msg = {"op": "quorum", "id": 7, "step_time": 0.25, 3: "x", "failed_epoch": None}
    with_orjson = jsontext.dumps(msg)
    monkeypatch.setattr(jsontext, "orjson", None)
    assert jsontext.dumps(msg) == with_orjson
    back = jsontext.loads(with_orjson)
    assert back["3"] == "x" and back["failed_epoch"] is None and back["step_time"] == 0.25
    assert math.isnan(jsontext.loads(jsontext.dumps({"loss": float("nan")}))["loss"])
    with pytest.raises(ValueError):
        jsontext.loads(b"[1,")


def test_a_non_ascii_text_differs_in_its_bytes_only() -> None:
    # orjson writes UTF-8 where json writes \u escapes: the value read back is the same.
    msg = {"node": "nœud-ß"}
    assert jsontext.loads(jsontext.dumps(msg)) == json.loads(json.dumps(msg)) == msg
