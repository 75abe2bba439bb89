"""Errors in OpenAI's shape, with the HTTP status (and gRPC code) each kind goes out with."""

from __future__ import annotations

from pydantic import ValidationError

from cluster.config.errors import format_validation_error
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
    info = ErrorInfo(
        message=message, type=_TYPES.get(status, "server_error"), param=param, code=code
    )
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
