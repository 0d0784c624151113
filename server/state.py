"""ServerState: the serving phase, the engine once loaded, admission. Front-neutral: each
front follows the phase its own way (gRPC's health servicer through ``phase_observers``,
server/grpc/health.py; HTTP's probes read ``phase``).

Invariants: every phase observer has seen the phase once ``set_phase`` returns;
``in_flight`` counts the generate calls admitted and not yet finished and never exceeds
``options.max_queue``. All of it is touched from the server's event loop only (the engine
thread reaches it through ``call_soon_threadsafe``), except ``adapter_of``: it only reads
(the options and ``model_name``, set once by ``attach``) and runs on the engine's
InputProcessor thread, in the hop that checks a request (server/generation.py).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..engine.async_engine import AsyncEngine
from ..engine.base_model_names import names_base_model
from .adapter_paths import check_canonical, is_loopback
from .error_code import ErrorCode, ServiceError
from .server_metrics import ServerMetrics
from .server_options import ServerOptions

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "STARTING"  # listening; the model is loading or warming up
    SERVING = "SERVING"
    DRAINING = "DRAINING"  # shutting down: new calls refused, in-flight ones finish
    DEAD = "DEAD"  # the engine loop died


_UNAVAILABLE_WHY = {
    Phase.STARTING: "the server is starting (the model is loading); retry when health "
                    "reports SERVING",
    Phase.DRAINING: "the server is shutting down and accepts no new requests; retry on "
                    "another replica",
    Phase.DEAD: "the engine has stopped after an internal fault; the server must be restarted",
}


class ServerState:
    def __init__(self, options: ServerOptions, exposed: bool | None = None):
        self.options = options
        # listens beyond loopback (runtime loads by path need --adapter-root or
        # --allow-any-adapter-path: adapter_paths.check_path_loading); default: from --host
        self.exposed = not is_loopback(options.host) if exposed is None else exposed
        self.phase = Phase.STARTING
        self.engine: AsyncEngine | None = None
        # told each new phase, in order (gRPC's health: server/grpc/health.py)
        self.phase_observers: list[Callable[[Phase], Awaitable[None]]] = []
        self.in_flight = 0
        self.requests_total = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.died = asyncio.Event()  # set with phase DEAD: ``serve`` then exits non-zero
        self.metrics = ServerMetrics()  # both fronts record into it
        self.model_name = ""  # the base's id; set by ``attach``
        # --lora-resolver-dir's AdapterResolver (server/adapter_resolver.py): set by its
        # ``attach``, which runs after this one's
        self.resolver: Any = None

    # ---- phase --------------------------------------------------------------------------
    async def set_phase(self, phase: Phase) -> None:
        if self.phase is Phase.DEAD:  # final: a late SERVING (load racing a death) is ignored
            return
        if phase is not self.phase:
            log.info("server phase: %s -> %s", self.phase.value, phase.value)
        self.phase = phase
        if phase is Phase.DEAD:
            self.died.set()
        for observe in self.phase_observers:
            await observe(phase)

    def attach(self, engine: AsyncEngine) -> None:
        """Serve ``engine``; its loop's death turns health NOT_SERVING (from any thread)."""
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        # the engine's rule (LLMEngine.model_name): its --served-model-name first
        self.model_name = engine.engine.model_name
        engine.engine.base_model_names = [self.model_name]  # adapter_of's names, in messages
        self.metrics.bind(self.model_name, engine.engine.lora_capacity.max_loras)
        engine.engine.adapter_load_observers.append(self.metrics.adapter_loaded)
        loop = self.loop

        def on_death(exc: BaseException) -> None:
            log.error("engine loop died: %r; health is NOT_SERVING", exc)
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.set_phase(Phase.DEAD)))

        engine.on_death = on_death

    @property
    def served_model_name(self) -> str | None:
        """--served-model-name: held once, by the engine's config (None before ``attach``)."""
        return None if self.engine is None else self.engine.engine.config.served_model_name

    def adapter_of(self, model: str) -> str | None:
        """A request's ``model`` as the engine's adapter: None for the base model (the
        engine's rule, ``names_base_model``), else the adapter name (which the InputProcessor
        looks up, NOT_FOUND if unknown); INVALID_ARGUMENT for a name that is not canonical
        (``x/../good`` would be ``good`` under another name). Any thread (it only reads)."""
        if names_base_model(model, self.served_model_name, self.model_name):
            return None
        return check_canonical(model)

    def tokenizer_of(self, model: str | None) -> Any:
        """The tokenizer of requests on ``model``: an adapter's own (one that adds tokens:
        lora/adapter_vocab.py), else the base model's. A name ``adapter_of`` refuses gets
        the base's here: the request's check refuses it with its own error."""
        engine = self.require_engine().engine
        try:
            adapter = self.adapter_of(model or "")
        except ValueError:
            adapter = None
        return engine.tokenizer_for(adapter)

    # ---- admission ----------------------------------------------------------------------
    def require_engine(self, while_draining: bool = False) -> AsyncEngine:
        """The engine, if calls are accepted now; UNAVAILABLE (or INTERNAL if dead) if not.
        ``while_draining``: read-only calls (info, stats) still work during a drain."""
        accepted = (Phase.SERVING, Phase.DRAINING) if while_draining else (Phase.SERVING,)
        if self.phase not in accepted or self.engine is None:
            code = ErrorCode.INTERNAL if self.phase is Phase.DEAD else ErrorCode.UNAVAILABLE
            raise ServiceError(code, _UNAVAILABLE_WHY.get(self.phase, "not serving"))
        return self.engine

    @contextmanager
    def admit(self) -> Iterator[AsyncEngine]:
        """Hold one of the ``max_queue`` in-flight places for a generate call."""
        with self.hold_place() as engine:
            self.requests_total += 1
            yield engine

    @contextmanager
    def hold_place(self) -> Iterator[AsyncEngine]:
        """One of the ``max_queue`` in-flight places: a generate call's, or the resolver's
        load made before a request is checked (so first uses load at most ``max_queue``
        adapters at once)."""
        engine = self.require_engine()
        limit = self.options.max_queue
        if self.in_flight >= limit:
            raise ServiceError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"the server has {self.in_flight} requests in flight, the most "
                               f"it takes (--max-queue {limit}); retry later")
        self.in_flight += 1
        try:
            yield engine
        finally:
            self.in_flight -= 1

