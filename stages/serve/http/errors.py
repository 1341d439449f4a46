"""OpenAI-style errors: every failure answers `{"error": {"message", "type", "param", "code"}}`.

`APIError` subclasses Starlette's HTTPException so that FastAPI passes it through untouched even
when it is raised while the body is read (the body-size limit does that).
"""
from __future__ import annotations

import logging
from types import NoneType, UnionType
from typing import Annotated, Union, get_args, get_origin

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from ...errors import LlmoptError
from ..engine.async_engine import EngineDeadError

log = logging.getLogger("llmopt.serve")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         503: "service_unavailable_error", 504: "timeout_error"}


class APIError(HTTPException):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None):
        super().__init__(status, message, headers)
        self.message, self.param, self.code = message, param, code
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def engine_dead(error: Exception) -> APIError:
    return APIError(503, f"the engine is not running ({error}); the server must be restarted", code="engine_dead")


def error_body(status: int, message: str, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.status_code, error.message, error.type, error.param, error.code),
                        status_code=error.status_code, headers=error.headers)


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(LlmoptError, _llmopt_error)
    app.add_exception_handler(Exception, _unexpected)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    if isinstance(exc, APIError):
        return error_response(exc)
    return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    field = getattr(request.scope.get("route"), "body_field", None)  # the route's body model, if it has one
    model = getattr(getattr(field, "field_info", None), "annotation", None)
    return error_response(validation_error(exc.errors(), model))


def validation_error(errors, model: type | None = None) -> APIError:
    """400 for the first field pydantic refused, named by the client's JSON path (OpenAI answers
    400, not 422). `model` is the body's pydantic model: it tells union-member tags from fields."""
    errors = list(errors)
    if not errors:
        return bad_request("invalid request body", code="invalid_value")
    if errors[0].get("type") == "json_invalid":
        why = (errors[0].get("ctx") or {}).get("error", "parse error")
        return bad_request(f"the request body is not valid JSON ({why})", code="invalid_json")
    path, chosen = _most_specific([(_where(error, model), error) for error in errors])
    return _describe(field_path(path) or None, chosen)


def field_path(parts) -> str:
    """A JSON path as OpenAI's errors write it: ("messages", 0, "content") is messages[0].content."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def user_path(loc, model: type | None = None) -> tuple:
    """A pydantic error location as the client's JSON path: without FastAPI's "body" and without the
    tag pydantic adds for the union member it tried ("str", "list[constrained-int]", a discriminator's
    value). Walking `model`'s annotations along the location tells a tag (it stands where the type
    is a union) from a field; with no model, the location is kept as it is."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    if model is None:
        return tuple(parts)
    path, types = [], [model]
    for part in parts:
        types = [_bare(t) for t in types]
        if any(_is_union(t) for t in types):
            types = [m for t in types if _is_union(t) for m in get_args(t) if m is not NoneType]
            continue
        path.append(part)
        types = [child for t in types if (child := _child(t, part)) is not None]
    return tuple(path)


def _bare(t):
    """`t` without Annotated metadata, and an Optional's one other member instead of the Optional."""
    while get_origin(t) is Annotated:
        t = get_args(t)[0]
    if _is_union(t):
        members = [m for m in get_args(t) if m is not NoneType]
        if len(members) == 1:
            return _bare(members[0])
    return t


def _is_union(t) -> bool:
    return get_origin(t) in (Union, UnionType)


def _child(t, part):
    """The type at `part` (a field name, dict key or list index) inside `t`; None when unknown."""
    if isinstance(part, int):
        return get_args(t)[0] if get_origin(t) is list and get_args(t) else None
    if isinstance(t, type) and issubclass(t, BaseModel):
        field = t.model_fields.get(part)
        return field.annotation if field is not None else None
    return get_args(t)[1] if get_origin(t) is dict and len(get_args(t)) == 2 else None


def _where(error: dict, model) -> tuple:
    path = user_path(error.get("loc", ()), model)
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # a message without a valid role
        discriminator = str((error.get("ctx") or {}).get("discriminator", "")).strip("'")
        if discriminator.isidentifier():
            path += (discriminator,)
    return path


def _most_specific(found: list[tuple[tuple, dict]]) -> tuple[tuple, list[dict]]:
    """The errors to report: of those about the first field named, the ones at its deepest path
    (a union reports each member's errors; the deepest came from the member the input's shape
    matched), a wrong value before wrong types, and wrong types at that path all together."""
    field = found[0][0][:1]
    same_field = [(path, error) for path, error in found if path[:1] == field]
    depth = max(len(path) for path, _ in same_field)
    deepest = [(path, error) for path, error in same_field if len(path) == depth]
    for path, error in deepest:
        if _expected(error) is None:
            return path, [error]
    path = deepest[0][0]
    return path, [error for p, error in deepest if p == path]


TYPE_NAMES = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
              "list_type": "an array", "dict_type": "an object", "model_type": "an object",
              "model_attributes_type": "an object"}


def _expected(error: dict) -> str | None:
    """What JSON type the field wanted, for an error that says the client sent another type."""
    kind = error.get("type")
    if kind == "invalid_type":  # our own unions' custom error: its message is what they take
        return error.get("msg")
    return TYPE_NAMES.get(kind)


def _json_type(value) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a decimal number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _describe(param: str | None, errors: list[dict]) -> APIError:
    first = errors[0]
    kind, ctx = first.get("type"), first.get("ctx") or {}
    name = param or "the request body"
    if kind in ("missing", "union_tag_not_found"):
        return bad_request(f"{name} is required", param, "missing_required_parameter")
    expected = list(dict.fromkeys(e for e in map(_expected, errors) if e))
    if expected:
        wanted = expected[0] if len(expected) == 1 else f"{', '.join(expected[:-1])} or {expected[-1]}"
        return bad_request(f"{name}: expected {wanted}, got {_json_type(first.get('input'))}", param, "invalid_type")
    if kind == "union_tag_invalid":
        message = f"must be one of {ctx.get('expected_tags', '')}"
    elif kind == "too_long" and "max_length" in ctx:
        message = f"at most {ctx['max_length']} items are allowed, got {ctx.get('actual_length', 'more')}"
    elif kind == "too_short" and ctx.get("min_length") == 1:
        message = "must not be empty"
    else:
        message = first.get("msg", "invalid value")
    return bad_request(f"{name}: {message}", param, "invalid_value")


async def _llmopt_error(request: Request, exc: LlmoptError) -> JSONResponse:
    if isinstance(exc, EngineDeadError):
        return error_response(engine_dead(exc))
    return error_response(bad_request(str(exc)))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error while serving %s", request.url.path)
    return error_response(APIError(500, f"internal server error ({exc.__class__.__name__}); see the server log",
                                   code="internal_error"))
