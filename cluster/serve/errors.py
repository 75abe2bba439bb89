"""Errors in OpenAI's shape, with the HTTP status (and gRPC code) each kind goes out with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from cluster.config.errors import format_error_details, format_validation_error
from cluster.openai_api.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    408: "timeout_error",
    503: "service_unavailable",
}
GRPC_CODE_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    503: "UNAVAILABLE",
    500: "INTERNAL",
}


def error_response(
    message: str, status: int = 400, *, param: str | None = None, code: str | None = None
) -> ErrorResponse:
    """An OpenAI error body going out with HTTP `status`."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    info = ErrorInfo(message=message, type=kind, param=param, code=code)
    return ErrorResponse(error=info, status=status)


def bad_request(message: str, param: str | None = None) -> ErrorResponse:
    return error_response(message, 400, param=param)


def model_not_found(model: str) -> ErrorResponse:
    return error_response(
        f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
    )


def invalid_api_key() -> ErrorResponse:
    return error_response("Incorrect API key provided.", 401, code="invalid_api_key")


def unavailable(message: str) -> ErrorResponse:
    return error_response(message, 503)


def from_validation_error(error: ValidationError) -> ErrorResponse:
    """A 400 naming the first invalid field."""
    errors = error.errors(include_url=False)
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return bad_request(format_validation_error(error), param=param)


def from_body_errors(details: Sequence[Any]) -> ErrorResponse:
    """A 400 from FastAPI's errors of a request body (locations start with "body"): the first
    invalid field is the `param`; a body that is not JSON says so."""
    fields = [{**item, "loc": tuple(item["loc"])[1:]} for item in details]
    if fields and fields[0]["type"] == "json_invalid":
        reason = fields[0].get("ctx", {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {reason}".rstrip(": "))
    if fields and not fields[0]["loc"] and isinstance(fields[0].get("input"), bytes):
        return bad_request("the request body must be JSON (Content-Type: application/json)")
    param = ".".join(str(part) for part in fields[0]["loc"]) if fields else None
    return bad_request(format_error_details(fields) or "invalid request body", param=param or None)
