"""The one error handler: every error leaves the router as an OpenAI error envelope."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from router.errors import APIError

logger = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers or None)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        err = APIError(str(exc.detail), status=exc.status_code, code=code)
        return JSONResponse(err.to_dict(), status_code=exc.status_code, headers=exc.headers)

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(str(exc), status=400, code="invalid_value"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
