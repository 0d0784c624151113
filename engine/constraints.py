"""The engine's side of structured outputs (structured/): the request checks (the fields that
cannot go with a constraint, the constraint's size limits), the grammar compiler of this
model (its worker processes start on the first compile), a sequence's matcher, and
advancing matchers with the sampled tokens.

A constrained sequence holds its ConstraintMatcher in ``Sequence.matcher``; a free one holds
None. The step's bitmask is filled and applied by the ModelRunner (structured/bitmask.py).
The grammar is requested last, once every other check of the request passed
(engine/input_processor.py: ``InputProcessor.compile`` / ``compile_async``, awaited off the
processor's and the engine's threads).
"""

from __future__ import annotations

from ..errors import InvalidRequestError
from ..structured.compiler import CompileSettings, GrammarCompiler
from ..structured.constraint import StructuredOutputs
from ..structured.limits import ConstraintLimits
from ..structured.matcher import ConstraintMatcher
from .engine_config import EngineConfig
from .sampling_params import SamplingParams
from .sequence import Sequence


def compile_settings(cfg: EngineConfig) -> CompileSettings:
    return CompileSettings(
        timeout_s=cfg.grammar_compile_timeout, workers=cfg.grammar_compile_workers,
        max_pending=cfg.max_pending_grammars, max_compiled_bytes=cfg.max_compiled_grammar_bytes,
        memory_bytes=cfg.grammar_compile_memory)


def constraint_limits(cfg: EngineConfig) -> ConstraintLimits:
    return ConstraintLimits(max_bytes=cfg.max_grammar_bytes, max_depth=cfg.max_schema_depth,
                            max_pattern_repetition=cfg.max_pattern_repetition)


class Constraints:
    def __init__(self, tokenizer: object | None, vocab_size: int, eos_token_ids: frozenset[int],
                 config: EngineConfig | None = None):
        config = config or EngineConfig()
        self.limits = constraint_limits(config)
        # the compiler reads the tokenizer on its first compile, not here
        self._compiler = None if tokenizer is None else \
            GrammarCompiler(tokenizer, vocab_size, eos_token_ids, compile_settings(config))

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            raise InvalidRequestError("structured_outputs: this model has no tokenizer, and "
                                      "a grammar is compiled against one")
        return self._compiler

    def check(self, params: SamplingParams) -> None:
        """The fields that cannot go with a constraint, and the constraint's size limits
        (InvalidRequestError naming them); ``params`` validated. Compiles nothing."""
        c = params.structured_outputs
        if c is None:
            return
        if params.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be combined with structured_outputs: "
                                      "the answer ends with EOS where the grammar does")
        if params.min_new_tokens:
            raise InvalidRequestError(
                "min_new_tokens cannot be combined with structured_outputs: the grammar "
                "decides where the answer may end")
        assert isinstance(c, StructuredOutputs)  # SamplingParams.validate made it one
        try:
            self.limits.check(c)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        self.compiler  # noqa: B018 - a model without a tokenizer refuses here, before a compile

    def compile(self, params: SamplingParams) -> object | None:
        """Block until the request's grammar is compiled (None for a free request);
        ``check`` first. CapacityError if the compiler is full."""
        if params.structured_outputs is None:
            return None
        try:
            return self.compiler.compile(params.structured_outputs)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    async def compile_async(self, params: SamplingParams) -> object | None:
        """``compile`` for an event loop (the loop runs on while it compiles)."""
        if params.structured_outputs is None:
            return None
        try:
            return await self.compiler.compile_async(params.structured_outputs)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()

    @staticmethod
    def attach(seq: Sequence, compiled: object | None) -> None:
        """Give ``seq`` its matcher, at the place of its output tokens so far."""
        if compiled is not None:
            seq.matcher = ConstraintMatcher(compiled, seq.seq_id)
            seq.matcher.sync(seq.output_token_ids)

    @staticmethod
    def advance(seq: Sequence, token: int) -> str | None:
        """Advance ``seq``'s matcher by its sampled ``token``: None, or "error" (with
        ``seq.error`` set) if the grammar refuses it, which the bitmask should prevent."""
        if seq.matcher is None or seq.matcher.accept(token):
            return None
        seq.error = (f"token {token} sampled after {seq.num_output_tokens} generated tokens "
                     "breaks the structured_outputs grammar")
        return "error"
