"""Reading users' files (`oases_jax.files`) and validating them (`oases_jax.schema`): each refusal
is one line naming the path, the JSON path inside it and the fix."""

import os
from typing import Annotated

import pytest
from pydantic import Field

from oases_jax.errors import UserError
from oases_jax.files import (
    MAX_JSON_DEPTH,
    loads,
    output_dir,
    output_file,
    read_json,
    regular_file,
)
from oases_jax.schema import Strict, at_most, exactly, one_of, validate


def refusal(fn, *args) -> str:
    with pytest.raises(UserError) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("text, message", [
    ('{"a": [1, {"b": NaN}]}', "f: a[1].b = NaN: JSON numbers must be finite"),
    ('{"a": -Infinity}', "f: a = -Infinity"),
    ('{"a": 1e999}', "f: a = 1e999"),
    ('{"m": {"x": 1, "x": 2}}', "f: m.x is given twice"),
    ('{"a": ' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1),
     "f: " + ".".join(["a"] * MAX_JSON_DEPTH) + " nests lists or objects more than 32 deep"),
    ("[" * 100_000 + "]" * 100_000, "f nests lists or objects more than 32 deep"),
    ("1" * 5000, "f holds an integer of thousands of digits"),
    ('{"a": 1', "f is not valid JSON (Expecting ',' delimiter: line 1 column 8)"),
])
def test_loads_refuses_what_json_allows_but_we_do_not(text, message):
    assert refusal(loads, text, "f", "fix it").startswith(message)
    assert refusal(loads, text, "f", "fix it").endswith("; fix it")


def test_loads_keeps_valid_documents_as_json_gives_them():
    text = '{"a": 1.5, "b": [1, 2, {"c": null}], "d": "x", "e": 10000000000000000000000}'
    assert loads(text, "f", "fix") == {"a": 1.5, "b": [1, 2, {"c": None}], "d": "x",
                                       "e": 10**22}
    depth = MAX_JSON_DEPTH - 1
    assert loads("[" * depth + "]" * depth, "f", "fix") is not None


def test_only_regular_files_are_read(tmp_path):
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * 11)
    (tmp_path / "bad").write_bytes(b'{"a": "\xff"}')
    (tmp_path / "link").symlink_to("/dev/zero")
    for name, said in (("dir", "is a directory, not a regular file"),
                       ("fifo", "is a FIFO, not a regular file"),
                       ("link", "is a character device, not a regular file"),
                       ("none", "does not exist")):
        assert f"plan {str(tmp_path / name)!r} {said}; fix" == refusal(
            regular_file, tmp_path / name, "plan", "fix")
    assert "is 11 bytes, more than the 10" in refusal(regular_file, tmp_path / "big", "p", "f",
                                                      10)
    assert "is not UTF-8 text (byte 7)" in refusal(read_json, tmp_path / "bad", "p", "f")
    assert "does not exist" in refusal(regular_file, tmp_path / "big" / "below", "p", "f")


def test_output_paths_are_checked_before_writing(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    assert output_file(tmp_path / "new" / "out.json", "--json") == tmp_path / "new" / "out.json"
    assert output_dir(tmp_path / "dir", "--out-dir") == tmp_path / "dir"
    assert "--json" in refusal(output_file, tmp_path / "dir", "--json")
    assert "is a directory" in refusal(output_file, tmp_path / "dir", "--json")
    assert "which is a file, not a directory" in refusal(output_file,
                                                         tmp_path / "file" / "x" / "y", "--json")
    assert "is a file, not a directory" in refusal(output_dir, tmp_path / "file", "--out-dir")
    assert "is a character device" in refusal(output_file, "/dev/null", "--json")
    assert "empty path" in refusal(output_dir, "", "--out-dir")


class Layer(Strict):
    schedule: one_of(("megatron", "oases"), "schedule")
    sub_batches: at_most(8) = 1


class Doc(Strict):
    version: exactly(1, "version") = 1
    layers: Annotated[list[Layer], Field(min_length=1)]
    mesh: dict[one_of(("data", "tensor"), "mesh axis"), at_most(8)] = {}


@pytest.mark.parametrize("doc, message", [
    ({"layers": [{"schedule": "oases", "sub_batches": 1.5}]},
     "w: layers[0].sub_batches = 1.5: must be an integer; fix"),
    ({"layers": [{"schedule": "oases", "sub_batches": True}]},
     "w: layers[0].sub_batches = True: must be an integer; fix"),
    ({"layers": [{"schedule": "oases", "sub_batches": 9}]},
     "w: layers[0].sub_batches = 9: must be at most 8 (a sanity cap); fix"),
    ({"layers": [{"schedule": "oases", "sub_batches": 0}]},
     "w: layers[0].sub_batches = 0: must be >= 1; fix"),
    ({"layers": [{"schedule": "Oases"}]},
     "w: layers[0].schedule: unknown schedule 'Oases'; choose one of megatron, oases; fix"),
    ({"layers": []}, "w: layers = []: must not be empty; fix"),
    ({"layers": [{"schedule": "oases", "remat": "full"}]},
     "w: layers[0].remat is not a field of a doc (misspelt?); fix"),
    ({}, "w is not a doc: layers is missing; fix"),
    ([], "w is not a doc (its top level is []); fix"),
    ({"version": 1.0, "layers": [{"schedule": "oases"}]},
     "w: version = 1.0: must be an integer; fix"),
    ({"version": 2, "layers": [{"schedule": "oases"}]},
     "w: version = 2: this version reads version 1 only; fix"),
    ({"layers": [{"schedule": "oases"}], "mesh": {" data": 2}},
     "w: key ' data' of mesh: unknown mesh axis ' data'; choose one of data, tensor; fix"),
])
def test_schema_errors_name_the_json_path_the_value_and_the_fix(doc, message):
    with pytest.raises(UserError) as e:
        validate(Doc, doc, where="w", kind="doc", fix="fix")
    assert str(e.value) == message
