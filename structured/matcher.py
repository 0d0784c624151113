"""ConstraintMatcher: one sequence's place in its grammar.

It advances with every token the sequence accepts (``accept``), fills that sequence's row
of a step's bitmask (``fill``; stop tokens are allowed only where the grammar accepts), is
copied for a fork of the sequence (``fork``: n > 1 samples of one prompt), and is rebuilt
from the sequence's tokens when it is behind them (``sync``: after preemption by
recompute, or for a sequence built with tokens already generated).

Invariant: ``num_tokens`` is the number of the sequence's output tokens it has accepted;
``owner`` names the one sequence that advances it (a copy of a sequence that still holds
its parent's matcher gets its own: ``own``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar


class ConstraintMatcher:
    def __init__(self, compiled: xgrammar.CompiledGrammar, owner: str = "",
                 _matcher: xgrammar.GrammarMatcher | None = None, _num_tokens: int = 0):
        self.compiled = compiled
        self.owner = owner
        self._m = _matcher if _matcher is not None else xgrammar.GrammarMatcher(compiled)
        self.num_tokens = _num_tokens

    def own(self, owner: str, tokens: Sequence[int]) -> ConstraintMatcher:
        """This matcher if ``owner`` owns it; else a new one for ``owner``, at the place of
        its ``tokens`` (a sequence forked or copied with its parent's matcher)."""
        if owner == self.owner:
            return self
        mine = ConstraintMatcher(self.compiled, owner)
        mine.sync(tokens)
        return mine

    def accept(self, token: int) -> bool:
        """Advance by one generated token; False (the state unchanged) if the grammar
        refuses it."""
        if not self._m.accept_token(token):
            return False
        self.num_tokens += 1
        return True

    def sync(self, tokens: Sequence[int]) -> None:
        """Bring the state to "``tokens`` accepted": nothing to do when it is there already;
        rebuilt from the start otherwise. ValueError if the grammar refuses one."""
        if self.num_tokens == len(tokens):
            return
        self._m.reset()
        self.num_tokens = 0
        for i, token in enumerate(tokens):
            if not self.accept(token):
                raise ValueError(f"token {token} at output position {i} breaks the grammar")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, packed: bit j of
        word w allows token 32·w + j)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def fork(self, owner: str = "") -> ConstraintMatcher:
        """An independent copy at the same place for ``owner`` (the grammar is shared)."""
        return ConstraintMatcher(self.compiled, owner, self._m.fork(), self.num_tokens)

    @property
    def handle(self) -> xgrammar.GrammarMatcher:
        """xgrammar's matcher (for its batched fill)."""
        return self._m

    @property
    def finished(self) -> bool:
        """A stop token was accepted: the answer is complete."""
        return self._m.is_terminated()

    @property
    def complete(self) -> bool:
        """The tokens so far form a whole answer (a stop token may come next)."""
        return self._m.is_completed()
