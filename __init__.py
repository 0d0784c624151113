"""loraplex: a multi-LoRA serving engine."""

from .engine.config import EngineConfig
from .engine.llm_engine import LLMEngine
from .engine.output_processor import RequestOutput
from .engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
