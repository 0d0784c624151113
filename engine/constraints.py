"""The engine's side of structured outputs (structured/): the request checks, the grammar
compiler of this model (built on first use), a sequence's matcher, and advancing matchers
with the sampled tokens.

A constrained sequence holds its ConstraintMatcher in ``Sequence.matcher``; a free one holds
None. The step's bitmask is filled and applied by the ModelRunner (structured/bitmask.py).
"""

from __future__ import annotations

from ..structured.compiler import GrammarCompiler
from ..structured.constraint import StructuredOutputs
from ..structured.matcher import ConstraintMatcher
from .errors import InvalidRequestError
from .sampling_params import SamplingParams
from .sequence import Sequence


class Constraints:
    def __init__(self, tokenizer: object | None, vocab_size: int, eos_token_ids: frozenset[int]):
        # the compiler reads the tokenizer on its first compile, not here
        self._compiler = None if tokenizer is None else \
            GrammarCompiler(tokenizer, vocab_size, eos_token_ids)

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            raise InvalidRequestError("structured_outputs: this model has no tokenizer, and "
                                      "a grammar is compiled against one")
        return self._compiler

    @staticmethod
    def check(params: SamplingParams) -> None:
        """The fields that cannot go with a constraint (InvalidRequestError naming them)."""
        if params.structured_outputs is None:
            return
        if params.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be combined with structured_outputs: "
                                      "the answer ends with EOS where the grammar does")
        if params.min_new_tokens:
            raise InvalidRequestError(
                "min_new_tokens cannot be combined with structured_outputs: the grammar "
                "decides where the answer may end")

    def compile(self, params: SamplingParams) -> object | None:
        """Block until the request's grammar is compiled (None for a free request)."""
        if params.structured_outputs is None:
            return None
        try:
            return self.compiler.compile(params.structured_outputs)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    async def compile_async(self, params: SamplingParams | None) -> object | None:
        """``compile`` for an event loop (the loop runs on while it compiles)."""
        if params is None or not isinstance(params.structured_outputs, StructuredOutputs):
            return None  # make_sequence checks the field
        try:
            return await self.compiler.compile_async(params.structured_outputs)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

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
