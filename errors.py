"""Errors raised to loraplex's callers by the engine and the adapter cache; the servers map
each to one status (gRPC code, HTTP status). This module imports nothing: it is the bottom
of the package's layers."""


class InvalidRequestError(ValueError):
    """A request field is wrong; the message names it and what is allowed."""


class AdapterNotFoundError(LookupError):
    """No adapter of that name is registered."""


class AdapterExistsError(ValueError):
    """An adapter of that name is already registered (and replace was not asked for)."""


class AdapterFaultError(RuntimeError):
    """A registered adapter cannot serve: its data failed a request (its logits held NaN or
    Inf, or a re-read of its files was refused). Not the engine's fault nor the request's:
    replace or unload the adapter; other adapters and the base model are unaffected."""


class CapacityError(RuntimeError):
    """A bounded resource is full (e.g. the grammar compiles pending); the request may be
    retried later. Not the request's fault: never cached as its answer."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an internal fault."""


class AdapterConfinementError(ValueError):
    """A file an adapter's directory holds (or names) lies outside the root the adapter is
    confined to (a symlink out of ``--adapter-root``, the resolver's directory, an upload's
    directory): refused, never read. The servers answer PERMISSION_DENIED."""
