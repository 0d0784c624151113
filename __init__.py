"""loraplex: a multi-LoRA serving engine.

The engine classes are imported lazily, so that ``loraplex.client`` (and the CLI's client
commands) start without loading torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EngineConfig": ".engine.engine_config",
    "LLMEngine": ".engine.llm_engine",
    "RequestOutput": ".engine.output_processor",
    "SamplingParams": ".engine.sampling_params",
    "StructuredOutputs": ".structured.constraint",
    "TokenLogprob": ".engine.logprobs",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .engine.engine_config import EngineConfig as EngineConfig
    from .engine.llm_engine import LLMEngine as LLMEngine
    from .engine.logprobs import TokenLogprob as TokenLogprob
    from .engine.output_processor import RequestOutput as RequestOutput
    from .engine.sampling_params import SamplingParams as SamplingParams
    from .structured.constraint import StructuredOutputs as StructuredOutputs


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
