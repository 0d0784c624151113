"""Errors the engine raises to its callers; the server maps each to one gRPC status."""


class InvalidRequestError(ValueError):
    """A request field is wrong; the message names it and what is allowed."""


class AdapterNotFoundError(LookupError):
    """No adapter of that name is registered."""


class AdapterExistsError(ValueError):
    """An adapter of that name is already registered (and replace was not asked for)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an internal fault."""
