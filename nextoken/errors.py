"""Typed errors. `InvalidRequest` is the user's mistake (HTTP 4xx); `EngineError` is ours (5xx).

Both carry a message meant to be shown to a person as one line: what is wrong and what to do.
"""


class NextokenError(Exception):
    """Base of every error nextoken raises on purpose."""


class InvalidRequest(NextokenError, ValueError):
    """A request, parameter or input the user gave is invalid.

    `field` names the offending parameter (e.g. ``"top_p"``) when there is one.
    """

    status = 400  # the HTTP status the server answers it with

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickled with its field (the engine process sends it to the server's)
        return type(self), (str(self), self.field)


class NotFound(InvalidRequest):
    """What the request names does not exist: an unknown model, a trace that is gone, a position
    past a trace's end, a tensor the file does not hold (HTTP 404)."""

    status = 404


class DependencyFailed(InvalidRequest):
    """A service the request names failed (an MCP server that is down, hangs or refuses):
    HTTP 424, the request itself may be fine."""

    status = 424


class ModelLoadError(NextokenError):
    """A model could not be found, downloaded, verified or read."""


class EngineError(NextokenError, RuntimeError):
    """An internal failure of the engine (a bug or a resource problem, not the user's input)."""


class RequestFailed(EngineError):
    """One request failed inside the engine (its model pass produced non-finite logits); the
    other requests of its batch go on (HTTP 500: the server's fault, not the request's)."""

    status = 500
