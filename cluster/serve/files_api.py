"""`/v1/files`: upload (multipart, `purpose=batch`), list, retrieve, content, delete.

The routes run in the ingress replica and keep nothing there: each call goes to the app's
`BatchService` actor, which owns the store. The multipart body is read with the standard
library's MIME parser (the form has two fields: `purpose` and `file`).
"""

from __future__ import annotations

import email.parser
import email.policy
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cluster.openai_api.batch_protocol import FileDeleted, FileList, FileObject
from cluster.openai_api.protocol import ErrorResponse
from cluster.serve import errors
from cluster.serve.batch_service import ask_service
from cluster.serve.openapi_docs import error_responses

router = APIRouter()
UPLOAD_PURPOSES = ("batch",)
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
                    },
                }
            }
        },
    }
}


def error_json(error: ErrorResponse) -> JSONResponse:
    return JSONResponse(error.model_dump(), status_code=error.status)


def multipart_fields(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """The form's fields: name -> (filename, bytes); ValueError when it is not multipart."""
    if not content_type.startswith("multipart/form-data"):
        raise ValueError("upload the file as multipart/form-data (fields 'file' and 'purpose')")
    head = f"Content-Type: {content_type}\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            payload = part.get_payload(decode=True)
            fields[str(name)] = (
                part.get_filename(),
                payload if isinstance(payload, bytes) else b"",
            )
    return fields


@router.post(
    "/v1/files",
    response_model=FileObject,
    responses=error_responses(400, 401),
    openapi_extra=_UPLOAD_BODY,
)
async def upload_file(raw: Request) -> Response:
    """Upload a JSONL file of batch requests (`purpose`: `batch`)."""
    try:
        fields = multipart_fields(raw.headers.get("content-type", ""), await raw.body())
    except ValueError as error:
        return error_json(errors.bad_request(str(error)))
    if "file" not in fields:
        return error_json(errors.bad_request("the form has no 'file' field", param="file"))
    purpose = fields.get("purpose", (None, b""))[1].decode(errors="replace")
    if purpose not in UPLOAD_PURPOSES:
        message = f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}"
        return error_json(errors.bad_request(message, param="purpose"))
    filename, content = fields["file"]
    info = await ask_service("create_file", filename or "upload.jsonl", purpose, content)
    return JSONResponse(info.model_dump())


@router.get("/v1/files", response_model=FileList, responses=error_responses(401))
async def list_files() -> Response:
    files: list[FileObject] = await ask_service(
        "files",
    )
    return JSONResponse(FileList(data=files).model_dump())


def _no_file(file_id: str) -> JSONResponse:
    return error_json(errors.error_response(f"no file {file_id!r}", 404, param="file_id"))


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=error_responses(401, 404))
async def retrieve_file(file_id: str) -> Response:
    info: FileObject | None = await ask_service("file", file_id)
    return _no_file(file_id) if info is None else JSONResponse(info.model_dump())


@router.get(
    "/v1/files/{file_id}/content",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes."},
        **error_responses(401, 404),
    },
)
async def file_content(file_id: str) -> Response:
    content: bytes | None = await ask_service("content", file_id)
    if content is None:
        return _no_file(file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete(
    "/v1/files/{file_id}", response_model=FileDeleted, responses=error_responses(401, 404)
)
async def delete_file(file_id: str) -> Response:
    deleted: bool = await ask_service("delete_file", file_id)
    return JSONResponse(FileDeleted(id=file_id).model_dump()) if deleted else _no_file(file_id)


__all__: list[Any] = ["router"]
