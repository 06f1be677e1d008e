"""Every refused request in OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, whichever layer
finds the fault: the framework reading the body (not UTF-8, not JSON, no such route), pydantic checking it (a wrong
type, a missing or null field, an argument this server does not know) and the server's own checks (`BadRequest`).
A validation failure is a 400, as OpenAI and vLLM answer it, with a message naming the field and what it takes.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

SHOWN_INPUT_CHARS = 60  # of a refused value, in the message


class BadRequest(Exception):
    """A request this server refuses: `status`, OpenAI's error `kind` and the `param` at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def install_error_handlers(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Route every error `app` raises through `error_response`; `models` are the request bodies, whose field names
    tell a field in an error's location from the tag pydantic adds for a member of a union."""
    fields = _field_names(models)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        message, param = validation_message(err.errors(), fields)
        return error_response(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        if err.status_code == 400:  # the framework could not read the body: FastAPI says only that
            return error_response(400, "the request body could not be read: send a JSON object encoded as UTF-8 "
                                       "(Content-Type: application/json)")
        if err.status_code == 404:
            return error_response(404, f"no endpoint {request.url.path}; this server has /v1/completions, "
                                       "/v1/chat/completions, /v1/models, /health and /metrics")
        if err.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}")
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(BadRequest)
    async def bad(request: Request, err: BadRequest):
        return error_response(err.status, str(err), err.kind, err.param)


def validation_message(errors: list[dict[str, Any]], fields: set[str]) -> tuple[str, str | None]:
    """One message for pydantic's `errors` of a request body, and the field at fault (None: the body itself).

    A value that fits no member of a union gives one error per member; the deepest location is the member the value
    came closest to, and the errors there are joined into one sentence."""
    if not errors:
        return "the request body is invalid", None
    if any(e.get("type") == "json_invalid" for e in errors):
        where = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error")
        return "the request body is not valid JSON" + (f" ({where})" if where else ""), None
    located = [(_path(e, fields), e) for e in errors]
    deepest = max(len(path) for path, _ in located)
    path = next(path for path, _ in located if len(path) == deepest)
    here = [e for p, e in located if p == path]
    first = here[0]
    name = _dotted(path)
    if first["type"] == "extra_forbidden":
        return f"unrecognized request argument {name!r}: this server does not take it; remove it", name
    subject = name or "the request body"
    if first["type"] == "missing":
        return f"{subject} is required" + ("" if name else ": send a JSON object"), name
    if first.get("input") is None and "input" in first:
        return f"{subject} must not be null", name
    wants = []
    for e in here:
        msg = str(e.get("msg", "is invalid"))
        msg = msg[len("Input should be "):] if msg.startswith("Input should be ") else msg
        msg = msg.replace("a valid dictionary or object to extract fields from", "a JSON object")
        if msg not in wants:
            wants.append(msg)
    return f"{subject} should be {' or '.join(wants)}, got {shown(first.get('input'))}", name


def _path(error: dict[str, Any], fields: set[str]) -> tuple[str | int, ...]:
    """The error's location in the body: fields and list indices, without "body" and pydantic's union tags."""
    loc = tuple(error.get("loc", ()))
    if loc[:1] == ("body",):
        loc = loc[1:]
    keep_last = error.get("type") == "extra_forbidden"  # the unknown argument's own name
    return tuple(part for i, part in enumerate(loc)
                 if isinstance(part, int) or part in fields or (keep_last and i == len(loc) - 1))


def _dotted(path: tuple[str | int, ...]) -> str | None:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def shown(value: Any) -> str:
    """`value` as JSON for a message, cut to `SHOWN_INPUT_CHARS` (a refused value may be any size)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= SHOWN_INPUT_CHARS else text[:SHOWN_INPUT_CHARS] + "..."


def _field_names(models: list[type[BaseModel]]) -> set[str]:
    names: set[str] = set()
    todo = list(models)
    while todo:
        model = todo.pop()
        for name, field in model.model_fields.items():
            names.add(name)
            todo.extend(_models_in(field.annotation))
    return names


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]
