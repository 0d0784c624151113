"""Errors raised to loraplex's callers by the engine and the adapter cache; the servers map
each to one status (gRPC code, HTTP status). This module imports nothing: it is the bottom
of the package's layers."""


class InvalidRequestError(ValueError):
    """A request field is wrong; the message names it and what is allowed."""


class AdapterNotFoundError(LookupError):
    """No adapter of that name is registered."""


class AdapterExistsError(ValueError):
    """An adapter of that name is already registered (and replace was not asked for)."""


class CapacityError(RuntimeError):
    """A bounded resource is full (e.g. the grammar compiles pending); the request may be
    retried later. Not the request's fault: never cached as its answer."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an internal fault."""
