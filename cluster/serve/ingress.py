"""`OpenAiIngress`: the OpenAI HTTP routes (FastAPI) and gRPC methods in front of the models.

The routes take the pydantic request models as their bodies, so FastAPI validates them and
`/openapi.json` describes every route (answers: `openapi_docs`); a body that fails validation
is a 400 in OpenAI's shape, and a missing or wrong API key a 401 before the body is looked at.
Each request goes by `model` to that model's
`LLMServer` deployment handle and relays what comes back: the first item of the server's stream
is peeked, so an error becomes a proper HTTP error (never a 200 stream that fails); a stream
that fails once begun (the replica died) ends with an error event in OpenAI's shape, then
`[DONE]`. When the client goes away, Serve cancels this call and, across the hop, the server's
stream.
"""

import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Protocol, cast

from fastapi import Depends, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config.env import api_key_from_env
from cluster.config.lora import served_model
from cluster.openai_api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from cluster.serve import errors
from cluster.serve.batches_api import router as batches_router
from cluster.serve.dev_routes import DevRoutes
from cluster.serve.dev_routes import router as dev_router
from cluster.serve.files_api import router as files_router
from cluster.serve.formatting import DONE, sse
from cluster.serve.grpc.methods import GrpcMethods
from cluster.serve.openapi_docs import (
    HEALTH_RESPONSES,
    DescribedApp,
    error_responses,
    generation_responses,
)

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"

app = DescribedApp(
    title="hybridserve",
    description="OpenAI-compatible API",
    strict_content_type=False,  # a body without a Content-Type is read as JSON (as before)
)


def error_json(error: ErrorResponse) -> JSONResponse:
    return JSONResponse(error.model_dump(), status_code=error.status)


def request_id_of(raw: Request) -> str:
    """The client's `x-request-id`, else the one Serve gave this request (and echoes back)."""
    given = raw.headers.get(REQUEST_ID_HEADER)
    if given:
        return given
    from ray.serve.context import _get_serve_request_context

    return _get_serve_request_context().request_id or uuid.uuid4().hex


class ItemStream(Protocol):
    """The rest of a model's answer as the routes relay it: Serve's response generator across
    the hop, or the model server's own generator when it serves the routes itself."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    async def __anext__(self) -> Any: ...

    def cancel(self) -> None: ...


class ApiError(Exception):
    """An OpenAI error raised where a route's dependency answers the request."""

    def __init__(self, error: ErrorResponse) -> None:
        super().__init__(error.error.message)
        self.error = error


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_json(exc.error)


@app.exception_handler(RequestValidationError)
async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_json(errors.from_body_errors(exc.errors()))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's and Starlette's own errors (an unknown path, a body that cannot be read) in
    OpenAI's shape too."""
    response = error_json(errors.error_response(str(exc.detail), exc.status_code))
    response.headers.update(exc.headers or {})
    return response


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error in %s", request.url.path)
    return error_json(errors.error_response(f"internal error: {exc}", 500))


BEARER = HTTPBearer(
    auto_error=False, description="The server's API key, when it has one (HYBRIDSERVE_API_KEY)."
)


async def require_api_key(
    raw: Request, _documented: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]
) -> None:
    """The key check of the routes that need it (run before the body is validated): the
    serving replica's `check_api_key` on the Authorization header."""
    ingress = cast("OpenAiIngress", serve.get_replica_context().servable_object)
    denied = ingress.check_api_key(raw.headers.get("authorization"))
    if denied is not None:
        raise ApiError(denied)


AUTHORIZED = [Depends(require_api_key)]


class OpenAiIngress(GrpcMethods, DevRoutes):
    """Routes OpenAI requests to the model deployments (the body of the ingress deployment)."""

    def __init__(self, servers: dict[str, DeploymentHandle[Any]]) -> None:
        self.servers = servers
        self.api_key = api_key_from_env()

    # -- shared by HTTP and gRPC --------------------------------------------------------------

    def check_api_key(self, authorization: str | None) -> ErrorResponse | None:
        if self.api_key is None:
            return None
        token = (authorization or "").removeprefix("Bearer ").strip()
        if secrets.compare_digest(token.encode(), self.api_key.encode()):
            return None
        return errors.invalid_api_key()

    def route(self, model: str | None) -> DeploymentHandle[Any] | ErrorResponse:
        if model is None:
            if len(self.servers) == 1:
                return next(iter(self.servers.values()))
            return errors.bad_request("model is required: several models are served", "model")
        served = served_model(model, self.servers)
        return self.servers[served[0]] if served is not None else errors.model_not_found(model)

    async def start(
        self, request: CompletionRequest | ChatCompletionRequest, request_id: str, as_sse: bool
    ) -> tuple[Any, ItemStream | None]:
        """Send `request` to its model; (first item or an error, rest of the stream)."""
        handle = self.route(request.model)
        if isinstance(handle, ErrorResponse):
            return handle, None
        stream = cast(
            "DeploymentResponseGenerator[Any]",
            handle.options(stream=True).generate.remote(request, request_id, as_sse),
        )
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return errors.error_response("the model returned nothing", 500), None
        except BackPressureError:
            return errors.unavailable("the server is overloaded; retry later"), None
        except RayServeException as error:
            return errors.unavailable(f"the model is unavailable: {error}"), None
        except RayActorError as error:  # the replica died before answering
            return errors.unavailable(f"the model is unavailable: {_first_line(error)}"), None
        if isinstance(first, ErrorResponse):
            return first, None
        return first, stream

    async def models(self) -> ModelList:
        """Every served model and the LoRA adapters each can serve."""
        cards = [card for h in self.servers.values() for card in await h.model_cards.remote()]
        return ModelList(data=cards)

    # -- HTTP -----------------------------------------------------------------------------------

    @app.post(
        "/v1/completions",
        response_model=None,
        responses=generation_responses(CompletionResponse, CompletionResponse),
        dependencies=AUTHORIZED,
    )
    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        return await self.http_generate(request, raw)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk),
        dependencies=AUTHORIZED,
    )
    async def chat_completions(self, request: ChatCompletionRequest, raw: Request) -> Response:
        return await self.http_generate(request, raw)

    @app.get(
        "/v1/models",
        response_model=ModelList,
        responses=error_responses(401),
        dependencies=AUTHORIZED,
    )
    async def list_models(self) -> Response:
        return JSONResponse((await self.models()).model_dump())

    @app.get(
        "/v1/models/{model:path}",
        response_model=ModelCard,
        responses=error_responses(401, 404),
        dependencies=AUTHORIZED,
    )
    async def get_model(self, model: str) -> Response:
        card = await self.find_model_card(model)
        if isinstance(card, ErrorResponse):
            return error_json(card)
        return JSONResponse(card.model_dump())

    @app.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
    async def health(self) -> Response:
        """200 when every model's engine and workers are healthy, else 503."""
        unhealthy = await self.unhealthy_model()
        if unhealthy is not None:
            return error_json(errors.unavailable(unhealthy))
        return Response(status_code=200)

    async def find_model_card(self, model: str) -> ModelCard | ErrorResponse:
        served = served_model(model, self.servers)
        if served is None:
            return errors.model_not_found(model)
        cards: list[ModelCard] = await self.servers[served[0]].model_cards.remote()
        return next((card for card in cards if card.id == model), errors.model_not_found(model))

    async def unhealthy_model(self) -> str | None:
        """Why the first unhealthy model is unhealthy; None when all are healthy."""
        for model_id, handle in self.servers.items():
            try:
                await handle.check_health.remote()
            except Exception as error:
                return f"model {model_id} is unhealthy: {error}"
        return None

    async def http_generate(
        self, request: CompletionRequest | ChatCompletionRequest, raw: Request
    ) -> Response:
        """Serve echoes `x-request-id` on every response; it is also the engine's request ID."""
        request_id = request_id_of(raw)
        first, stream = await self.start(request, request_id, as_sse=True)
        if isinstance(first, ErrorResponse):
            return error_json(first)
        if stream is None or not request.stream:
            if stream is not None:
                stream.cancel()
            return JSONResponse(first.model_dump())
        return StreamingResponse(_relay(first, stream), media_type="text/event-stream")


async def _relay(first: str, stream: ItemStream) -> AsyncIterator[str]:
    """The SSE lines: the peeked one, then the rest; cancels the server's stream if cut off.
    A stream that breaks (the replica died) ends with an error event, never a cut connection."""
    finished = False
    try:
        yield first
        async for line in stream:
            yield line
        finished = True
    except Exception as error:
        finished = True
        yield sse(_stream_failure(error))
        yield DONE
    finally:
        if not finished:
            stream.cancel()


def _stream_failure(error: Exception) -> ErrorResponse:
    if isinstance(error, RayActorError | RayServeException):
        return errors.unavailable(f"the model is unavailable: {_first_line(error)}")
    logger.error("a stream from the model failed", exc_info=error)
    return errors.error_response(f"internal error: {_first_line(error)}", 500)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


# The Files and Batch APIs (their own modules; state in the app's batch service actor).
app.include_router(files_router, dependencies=AUTHORIZED)
app.include_router(batches_router, dependencies=AUTHORIZED)

# The development routes (`/sleep`, `/wake_up`, ...): 404 unless HYBRIDSERVE_SERVER_DEV_MODE=1.
app.include_router(dev_router, dependencies=AUTHORIZED)

# Bound at import, so a replica that imports this module gets the same class-based routes
# (Serve pickles the module-level app by reference).
OpenAiIngressDeployment = serve.ingress(app)(OpenAiIngress)

__all__ = ["REQUEST_ID_HEADER", "ItemStream", "OpenAiIngress", "OpenAiIngressDeployment", "app"]
