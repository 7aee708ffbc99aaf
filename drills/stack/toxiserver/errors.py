"""The API's error type: Toxiproxy's ``ApiError`` (a message and an HTTP status)."""

from __future__ import annotations


class ApiError(Exception):
    """Rendered as ``{"error": message, "status": status}`` with that HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def joined(self, detail: str) -> ApiError:
        """Go's ``joinError``: ``"<message>: <detail>"`` with the same status."""
        return ApiError(f"{self.message}: {detail}", self.status)


BAD_REQUEST_BODY = ApiError("bad request body", 400)
MISSING_FIELD = ApiError("missing required field", 400)
PROXY_NOT_FOUND = ApiError("proxy not found", 404)
PROXY_EXISTS = ApiError("proxy already exists", 409)
INVALID_STREAM = ApiError("stream was invalid, can be either upstream or downstream", 400)
INVALID_TOXIC_TYPE = ApiError("invalid toxic type", 400)
TOXIC_EXISTS = ApiError("toxic already exists", 409)
TOXIC_NOT_FOUND = ApiError("toxic not found", 404)
