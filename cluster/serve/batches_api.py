"""`/v1/batches`: create (from an uploaded `input_file_id`), retrieve, list, cancel.

The routes run in the ingress replica and hand each call to the app's `BatchService` actor,
which validates the input, runs the batch in the background on the engine replicas and writes
its output and error files (`cluster.serve.batch_service`).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from cluster.openai_api.batch_protocol import BatchCreateRequest, BatchList, BatchObject
from cluster.openai_api.protocol import ErrorResponse
from cluster.serve import errors
from cluster.serve.batch_service import ask_service, served_models
from cluster.serve.files_api import error_json
from cluster.serve.openapi_docs import error_responses

router = APIRouter()


def _answer(result: BatchObject | ErrorResponse | None, batch_id: str = "") -> Response:
    if result is None:
        return error_json(errors.error_response(f"no batch {batch_id!r}", 404, param="batch_id"))
    if isinstance(result, ErrorResponse):
        return error_json(result)
    return JSONResponse(result.model_dump())


@router.post("/v1/batches", response_model=BatchObject, responses=error_responses(400, 401, 404))
async def create_batch(request: BatchCreateRequest) -> Response:
    """Start a batch over an uploaded file; it runs in the background (poll it)."""
    return _answer(await ask_service("create_batch", request, served_models()))


@router.get("/v1/batches", response_model=BatchList, responses=error_responses(401))
async def list_batches() -> Response:
    batches: list[BatchObject] = await ask_service(
        "batches",
    )
    page = BatchList(
        data=batches,
        first_id=batches[0].id if batches else None,
        last_id=batches[-1].id if batches else None,
    )
    return JSONResponse(page.model_dump())


@router.get(
    "/v1/batches/{batch_id}", response_model=BatchObject, responses=error_responses(401, 404)
)
async def retrieve_batch(batch_id: str) -> Response:
    return _answer(await ask_service("batch", batch_id), batch_id)


@router.post(
    "/v1/batches/{batch_id}/cancel",
    response_model=BatchObject,
    responses=error_responses(401, 404),
)
async def cancel_batch(batch_id: str) -> Response:
    """Stop a batch: lines in flight stop at once, finished ones go to its output file."""
    return _answer(await ask_service("cancel", batch_id), batch_id)
