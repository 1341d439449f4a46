"""OpenAI-style errors: every failure answers `{"error": {"message", "type", "param", "code"}}`.

`APIError` subclasses Starlette's HTTPException so that FastAPI passes it through untouched even
when it is raised while the body is read (the body-size limit does that).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ...errors import LlmoptError
from ..engine.async_engine import EngineDeadError

log = logging.getLogger("llmopt.serve")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
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
    return error_response(validation_error(exc.errors()))


def validation_error(errors) -> APIError:
    """400 for the first problem pydantic found, naming the field (OpenAI answers 400, not 422)."""
    first = next(iter(errors), {"loc": (), "msg": "invalid request", "type": ""})
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})",
                           code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    if first.get("type") == "missing" and param:
        return bad_request(f"{param} is required", param, "missing_required_parameter")
    return bad_request(f"{where}{first.get('msg', 'invalid value')}", param, "invalid_value")


async def _llmopt_error(request: Request, exc: LlmoptError) -> JSONResponse:
    if isinstance(exc, EngineDeadError):
        return error_response(engine_dead(exc))
    return error_response(bad_request(str(exc)))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error while serving %s", request.url.path)
    return error_response(APIError(500, f"internal server error ({exc.__class__.__name__}); see the server log",
                                   code="internal_error"))
