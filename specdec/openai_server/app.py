"""The app: FastAPI routes (``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``), errors as OpenAI's
error JSON, Bearer-token authentication, and :func:`serve` (uvicorn)."""

from __future__ import annotations

import hmac
from typing import Callable

from starlette.requests import Request  # module level: FastAPI resolves the handlers' annotations here

from .engine import Engine
from .errors import ApiError, api_error_for
from .request import (CHAT_PARAMS, COMPLETION_PARAMS, chat_request, check_body, check_content_type,
                      completion_request)
from .route_field import ROUTE_FIELD, routed
from .streaming import respond


def create_app(engine: Engine, api_keys: Callable[[str | None], bool] | None = None):
    """The FastAPI app of ``engine``.

    ``api_keys``: a check of the request's Bearer token (True = allowed); None = no authentication.
    """
    from fastapi import FastAPI

    app = FastAPI(title="specdec edge endpoint (OpenAI-compatible)", docs_url=None, redoc_url=None)
    app.state.engine = engine
    _add_error_handlers(app)
    if api_keys is not None:
        _add_auth(app, api_keys)

    async def read_body(request: Request, supported: set[str]) -> dict:
        check_content_type(request.headers.get("content-type"))
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body must be JSON") from None
        return check_body(body, supported | {ROUTE_FIELD}, engine.model_id)  # route: an extension

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [
            {"id": engine.model_id, "object": "model", "created": engine.created, "owned_by": "specdec"}]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        if model_id != engine.model_id:
            raise ApiError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return {"id": engine.model_id, "object": "model", "created": engine.created, "owned_by": "specdec"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = routed(chat_request, await read_body(request, CHAT_PARAMS), engine.tokenizer)
        return await respond(engine, req, "chat.completion", "chatcmpl-", getattr(request.state, "tenant", ""),
                             request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = routed(completion_request, await read_body(request, COMPLETION_PARAMS), engine.tokenizer)
        return await respond(engine, req, "text_completion", "cmpl-", getattr(request.state, "tenant", ""),
                             request)

    return app


def _error_response(err: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _add_error_handlers(app) -> None:
    """Every error answered in OpenAI's error JSON: ours, request validation, routing (404, 405)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc):
        return _error_response(ApiError(400, str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return _error_response(ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(RecursionError)  # json.loads of a body nested thousands deep
    async def _too_deep(_request, _exc):
        return _error_response(ApiError(400, "the request body is nested too deeply"))

    @app.exception_handler(Exception)  # anything else still answers in the error JSON (and is logged)
    async def _internal(_request, exc):
        return _error_response(api_error_for(exc))


def _add_auth(app, api_keys: Callable[[str | None], bool]) -> None:
    """Requests under /v1/ need a Bearer token that ``api_keys`` accepts (401 otherwise)."""

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            token = header[7:].strip() if header[:7].lower() == "bearer " else None
            if not api_keys(token):
                return _error_response(ApiError(401, "missing or invalid API key (authorization: Bearer KEY)",
                                                "invalid_request_error", code="invalid_api_key"))
            request.state.tenant = getattr(api_keys, "tenant_of", lambda _token: "")(token)  # the log line's
        return await call_next(request)


def key_checker(api_key: str | None = None,
                api_keys_file: str | None = None) -> Callable[[str | None], bool] | None:
    """The Bearer-token check of the endpoint: ``api_key`` (compared in constant time) and/or the key hashes of
    ``api_keys_file`` (the ``specdec keys create`` file, :class:`cloud_verifier.security.auth.ApiKeyStore`);
    None when neither is given (no authentication)."""
    store = None
    if api_keys_file:
        from specdec_runtime.cloud_verifier.security.auth import ApiKeyStore

        store = ApiKeyStore(api_keys_file)
    if not api_key and store is None:
        return None

    def check(token: str | None) -> bool:
        if not token:
            return False
        if api_key and hmac.compare_digest(token.encode(), api_key.encode()):
            return True
        return store is not None and store.tenant_for(token) is not None

    # the tenant a valid token names, for the request's log line: its key file's tenant, "edge" for --api-key
    check.tenant_of = lambda token: (store.tenant_for(token) if store is not None else None) or "edge"
    return check


def serve(engine: Engine, host: str, port: int, api_keys=None, on_started: Callable[[], None] | None = None) -> None:
    """Run the endpoint with uvicorn until interrupted (SIGINT/SIGTERM); closes ``engine`` at the end."""
    import uvicorn

    app = create_app(engine, api_keys)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if on_started is not None:
        original = server.startup

        async def startup(*args, **kwargs):
            await original(*args, **kwargs)
            if server.started:
                on_started()

        server.startup = startup
    try:
        server.run()
    finally:
        engine.close()
