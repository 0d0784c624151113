"""The errors the engine raises to its callers (defined at the package's bottom,
``loraplex.errors``, so that lora/ raises them too)."""

from ..errors import (  # noqa: F401  (re-exported: the engine's error surface)
    AdapterConfinementError,
    AdapterExistsError,
    AdapterFaultError,
    AdapterNotFoundError,
    CapacityError,
    EngineDeadError,
    InvalidRequestError,
)
