"""Engine failures raised by :class:`~megarl.rollout.client.SGLangClient` (its failure policy says
which is raised when); the router and the rollout workers handle them."""
from __future__ import annotations


class EngineError(RuntimeError):
    """Base class of engine failures raised by :class:`SGLangClient`."""


class EngineUnavailableError(EngineError):
    """The engine could not be reached (after the connection retries)."""


class EngineConnectionLost(EngineUnavailableError):
    """The connection dropped after the request was sent; the engine may or may not have run it."""


class EngineTimeoutError(EngineError):
    """No answer within the request timeout (the request was aborted on the engine)."""


class EngineRequestError(EngineError):
    """The engine answered with an HTTP error status.

    Attributes:
        status: the HTTP status code.
        body: the response body (text).
    """

    def __init__(self, path: str, status: int, body: str) -> None:
        super().__init__(f"{path} -> HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body
