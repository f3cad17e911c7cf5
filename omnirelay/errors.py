"""One small error hierarchy, shared by every component.

Each error names whether it can be recovered and maps to one HTTP status. On the bus an error
travels as ``(error_type, message)`` inside :class:`~omnirelay.broker.protocol.StageFailed` or
:class:`~omnirelay.broker.protocol.RequestFailed`; :func:`error_from_type` turns it back into the
class here, so the gateway answers with the right status whatever stage failed.
"""

from __future__ import annotations


class OmniError(Exception):
    """Base class. ``error_type`` is the stable wire name; ``status`` the HTTP status.

    ``recoverable``: the same request may succeed later (overload, no worker for a while, a lost
    worker, a failed transfer); the gateway answers these with ``Retry-After`` — ``retry_after``
    seconds where the broker gave a hint, else 1.
    """

    error_type = "internal_error"
    status = 500
    openai_type = "server_error"
    recoverable = False

    def __init__(self, message: str, *, request_id: str = "", stage: str = "", param: str | None = None,
                 retry_after: float = 0.0, resumable: bool = False):
        super().__init__(message)
        self.resumable = resumable  # the rest of the stream may be resumed on another worker
        self.message = message
        self.request_id = request_id
        self.stage = stage
        self.param = param
        self.retry_after = retry_after

    def to_body(self) -> dict:
        """The OpenAI-style error body plus our ``request_id`` and ``stage``."""
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.error_type,
            },
            "request_id": self.request_id or None,
            "stage": self.stage or None,
        }


class BadRequest(OmniError):
    error_type, status, openai_type = "bad_request", 400, "invalid_request_error"


class Unauthorized(OmniError):
    error_type, status, openai_type = "unauthorized", 401, "authentication_error"


class NotFound(OmniError):
    error_type, status, openai_type = "not_found", 404, "invalid_request_error"


class PayloadTooLarge(OmniError):
    error_type, status, openai_type = "payload_too_large", 413, "invalid_request_error"


class Unprocessable(OmniError):
    """A well-formed request asking for something this deployment does not do (n > 1, logprobs,
    an image for a text-only model)."""

    error_type, status, openai_type = "unprocessable", 422, "invalid_request_error"


class Overloaded(OmniError):
    error_type, status, openai_type, recoverable = "overloaded", 429, "rate_limit_error", True


class Unavailable(OmniError):
    """No live worker for a role the request needs."""

    error_type, status, openai_type, recoverable = "unavailable", 503, "server_error", True


class WorkerLost(OmniError):
    """The worker holding the request died and the request could not be moved."""

    error_type, status, openai_type, recoverable = "worker_lost", 503, "server_error", True


class TransferFailed(OmniError):
    """A connector could not move a stage's data (store or peer down, key lost). The broker restarts
    the request after a delay first; this reaches the client only once those attempts are spent."""

    error_type, status, openai_type, recoverable = "transfer_failed", 502, "server_error", True


class DeadlineExceeded(OmniError):
    error_type, status, openai_type = "deadline_exceeded", 504, "timeout_error"


class OutOfMemory(OmniError):
    error_type, status, openai_type = "out_of_memory", 507, "server_error"


class Cancelled(OmniError):
    error_type, status, openai_type = "cancelled", 499, "cancelled"


_BY_TYPE = {cls.error_type: cls for cls in (
    BadRequest, Unauthorized, NotFound, PayloadTooLarge, Unprocessable, Overloaded, Unavailable, WorkerLost,
    TransferFailed, DeadlineExceeded, OutOfMemory, Cancelled, OmniError)}


def error_from_type(error_type: str, message: str, **kwargs) -> OmniError:
    """The error class for a wire ``error_type``; unknown names become a 500 ``OmniError``."""
    return _BY_TYPE.get(error_type, OmniError)(message, **kwargs)


class InvalidParam(BadRequest, ValueError):
    """A request-parameter struct (omnirelay/request_params.py) refused a value. Where the gateway
    builds the struct it is a 400 naming ``param``; where the bus decodes one, being a
    ``ValueError`` makes msgspec report it as a validation error of the message."""
