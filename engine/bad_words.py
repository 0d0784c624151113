"""BadWords: a request's bad words as token ids, indexed once so that finding what they ban
at a step costs the length of the match, not the number of words.

vLLM's meaning (``apply_bad_words``): a word of one token is banned at every step; the last
token of a longer word is banned where the output ends with the word's other tokens.
``BadWords`` keeps the one-token words as a fixed set (``always``) and the longer ones in a
radix trie of their prefixes read backwards (the last prefix token first): a step walks back
from the last output token only as far as some prefix still matches. Edges hold runs of
tokens as int32 arrays, so the index holds 4 bytes a token and at most two nodes a word.

Invariant: ``set(always) | set(banned(outputs))`` is exactly the set of tokens the scan over
every word would ban after ``outputs`` (tests/test_bad_words.py checks it on random lists).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

TOKENS = "i"  # int32: every vocabulary's ids fit


class _Node:
    """The end of a prefix read backwards: the tokens that may not follow that prefix, and
    the longer prefixes, each behind an edge of one or more tokens."""

    __slots__ = ("edges", "ends")

    def __init__(self) -> None:
        self.ends: list[int] = []  # last tokens of the words whose prefix ends here
        self.edges: dict[int, tuple[array, _Node]] = {}  # first token -> (the run, node)


def _common(a: array, b: array) -> int:
    """The length of the run ``a`` and ``b`` start with (slices compare in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


class BadWords:
    """Built once per request (on the input processor's thread), read by the engine thread
    at each step of its choices (shared, never changed after building)."""

    __slots__ = ("_root", "always")

    def __init__(self, words: Iterable[Sequence[int]]):
        self._root = _Node()
        always: set[int] = set()
        for word in words:
            if len(word) == 1:
                always.add(word[0])
            elif word:
                self._insert(array(TOKENS, reversed(word[:-1])), word[-1])
        self.always: tuple[int, ...] = tuple(sorted(always))  # banned at every step

    def _insert(self, key: array, last: int) -> None:
        """Ban ``last`` after the prefix ``key`` (read backwards). Edges are split where a
        prefix ends inside one, so every prefix ends at a node."""
        node = self._root
        while key:
            edge = node.edges.get(key[0])
            if edge is None:
                child = _Node()
                node.edges[key[0]] = (key, child)
                node = child
                break
            run, child = edge
            j = _common(run, key)
            if j < len(run):
                split = _Node()
                split.edges[run[j]] = (run[j:], child)
                node.edges[key[0]] = (run[:j], split)
                child = split
            node, key = child, key[j:]
        node.ends.append(last)

    def banned(self, outputs: Sequence[int]) -> list[int]:
        """The last tokens of the multi-token words whose prefix ends ``outputs`` (duplicates
        possible); ``always`` is not included. Costs O(longest matching prefix + result)."""
        node, out, i = self._root, [], len(outputs) - 1
        while i >= 0:
            edge = node.edges.get(outputs[i])
            if edge is None:
                break
            run, node = edge
            n = len(run)
            if n > 1:  # run[0] matched: the rest must be the n - 1 tokens before it
                if n > i + 1:
                    break
                back = list(outputs[i - n + 1:i + 1])
                back.reverse()
                if array(TOKENS, back) != run:
                    break
            out += node.ends
            i -= n
        return out

    def nodes(self) -> int:
        """How many nodes the trie holds (at most two a word, besides the root)."""
        count, todo = 0, [self._root]
        while todo:
            node = todo.pop()
            count += 1
            todo += [child for _, child in node.edges.values()]
        return count
