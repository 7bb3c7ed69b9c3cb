"""Strict schemas (pydantic v2) for the files the scripts read, and the sanity caps they share
with the flags. A wrong type (a float, boolean or list where an integer belongs), a value out of
range or an unknown name is one UserError line: where, the JSON path, the value and the fix.

pydantic rather than jsonschema: its strict mode refuses 8.0, true and "8" for an integer as it
stands, each error carries its JSON path and input (the line names both), validators take their
names from the registries in code (`one_of`), and what comes out is typed objects, not a dict
checked once and then read with `int(d[...])` again."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import pydantic
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from oases_jax.errors import UserError
from oases_jax.files import path_label

# Sanity caps: a value past one is a typo or junk, not a workload (docs/cli.md, "Caps"). The
# largest published runs use a few thousand sequences per step (GPT-3: 1536 x 2048 tokens;
# LAMB's BERT: 65536 x 128) and clusters of about 10^5 devices.
MAX_DEVICES = 2**20
MAX_GLOBAL_BATCH = 2**17  # sequences per optimizer step
MAX_SEQ_LEN = 2**20  # tokens per sequence
MAX_TOKENS_PER_STEP = 2**27

class Strict(pydantic.BaseModel):
    """A file object: exact JSON types (no 8.0 for 8, no true for 1, no "8"), no unknown keys,
    finite numbers."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


def at_most(cap: int) -> type[int]:
    """A positive integer of at most `cap`."""
    return Annotated[int, Field(ge=1, le=cap)]


PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]


def one_of(choices: Iterable[str], what: str) -> type[str]:
    """A string among `choices` (kept in their order for the message)."""
    choices = tuple(choices)

    def check(value: str) -> str:
        if value not in choices:
            raise PydanticCustomError("unknown_name", "unknown {what} {value}; choose one of "
                                      "{choices}", {"what": what, "value": repr(value),
                                                    "choices": ", ".join(choices)})
        return value

    return Annotated[str, AfterValidator(check)]


def exactly(expected: object, what: str) -> type:
    """A value equal to `expected` and of its exact JSON type (`1`, not `true` or `1.0`)."""

    def check(value):
        if value != expected:
            raise PydanticCustomError("not_expected", "this version reads {what} {expected} only",
                                      {"what": what, "expected": repr(expected)})
        return value

    return Annotated[type(expected), AfterValidator(check)]


def pair(value: object) -> object:
    """A two-element JSON list as the tuple a `tuple[A, B]` field takes strictly."""
    return tuple(value) if isinstance(value, list) and len(value) == 2 else value


Pair = BeforeValidator(pair)

_PLAIN = {
    "int_type": "must be an integer", "float_type": "must be a number",
    "string_type": "must be a string", "bool_type": "must be true or false",
    "dict_type": "must be an object", "model_type": "must be an object",
    "model_attributes_type": "must be an object", "list_type": "must be a list",
    "tuple_type": "must be a list of two entries", "finite_number": "must be finite",
    "string_too_short": "must not be empty",
}


def _problem(err: dict) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in _PLAIN:
        return _PLAIN[kind]
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']}"
    if kind in ("less_than_equal", "less_than"):
        return f"must be at most {ctx.get('le', ctx.get('lt')):,} (a sanity cap)"
    if kind == "too_short":
        return "must not be empty"
    if kind == "too_long":
        return f"has more than {ctx['max_length']} entries"
    msg = err["msg"]
    return msg[:1].lower() + msg[1:]


def _value(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe(err: dict, where: str, kind: str, fix: str) -> str:
    """One pydantic error as one line: `WHERE: PATH = VALUE: PROBLEM; FIX`."""
    loc = tuple(err["loc"])
    if loc and loc[-1] == "[key]":
        return f"{where}: key {_value(loc[-2])} of {path_label(loc[:-2])}: {_problem(err)}; {fix}"
    path = path_label(loc)
    if err["type"] == "missing":
        return f"{where} is not a {kind}: {path} is missing; {fix}"
    if err["type"] == "extra_forbidden":
        return f"{where}: {path} is not a field of a {kind} (misspelt?); {fix}"
    if not loc:
        return f"{where} is not a {kind} (its top level is {_value(err['input'])}); {fix}"
    if err["type"] == "unknown_name":
        return f"{where}: {path}: {err['msg']}; {fix}"
    return f"{where}: {path} = {_value(err['input'])}: {_problem(err)}; {fix}"


def validate[M: pydantic.BaseModel](model: type[M], data: object, *, where: str, kind: str,
                                    fix: str) -> M:
    """`model` read from parsed JSON `data` (or the same built in Python, tuples taken as JSON
    lists); the first problem is a UserError (`describe`)."""
    try:
        return model.model_validate(_lists(data))
    except pydantic.ValidationError as e:
        raise UserError(describe(e.errors()[0], where, kind, fix)) from None


def _lists(value: object) -> object:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(v) for v in value]
    return value
