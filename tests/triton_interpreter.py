"""The Triton interpreter without its repeated re-patching of ``triton.language`` (tests only).

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor.__call__``) patches
``triton.language`` for the interpreter (``_patch_lang``: ``inspect.getmembers`` over the
language's modules), runs every program, then restores the originals. Every call of a
``@triton.jit`` helper from inside a kernel (``InterpretedFunction.__call__``) patches again
and drops that scope: on a language the launch has already patched this re-sets the same
wrappers (its builtins are already replaced, so ``getmembers`` finds none to wrap) and the
launch's restore undoes everything anyway. It costs ~3 ms a call, a third of a
decode-attention launch's time (the paged-KV helper runs once per tile).

:func:`install` skips exactly those redundant re-patches: a helper's ``_patch_lang`` is
skipped only while a launch on the same thread has patched a superset of the language
modules the helper sees. Launches, and anything else, patch as before, so the interpreted
programs and their results are unchanged. Installed only where the interpreter's code is the
one checked here (triton 3.x's ``runtime/interpreter.py``); elsewhere a no-op.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

_originals: list[Any] = []  # triton's _patch_lang and GridExecutor.__call__ while installed
_state = threading.local()  # .patched: per running launch, the ids of the lang modules patched


def _langs(fn: Callable[..., Any], lang_modules: tuple[object, ...]) -> frozenset[int]:
    """The ids of the ``triton.language`` modules visible in ``fn``'s globals (as
    ``_patch_lang`` finds them)."""
    return frozenset(id(v) for v in fn.__globals__.values()
                     if inspect.ismodule(v) and any(v is m for m in lang_modules))


class _NoScope:
    def restore(self) -> None:
        """Nothing to undo: the enclosing launch's scope restores the originals."""


def install() -> bool:
    """Wrap the interpreter's ``_patch_lang`` and ``GridExecutor.__call__``; True when
    installed (False: not the interpreter this was checked against)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if executor is None or function is None or patch_lang is None \
            or getattr(patch_lang, "_skips_nested", False):
        return getattr(patch_lang, "_skips_nested", False)
    try:  # the shapes relied on: launches restore their scope, helpers drop theirs
        if "patch_scope.restore()" not in inspect.getsource(executor.__call__) \
                or "_patch_lang(self.fn)" not in inspect.getsource(function.__call__):
            return False
    except (OSError, TypeError):
        return False
    lang_modules = (tl, tl.core)
    launch = executor.__call__

    def patch_lang_once(fn: Callable[..., Any]) -> object:
        stack = getattr(_state, "patched", None)
        langs = _langs(fn, lang_modules)
        if stack and langs and langs <= stack[-1]:
            return _NoScope()  # a helper inside a launch that patched these modules
        scope = patch_lang(fn)
        if stack:
            stack[-1] = stack[-1] | langs  # patched until the launch's restore
        return scope

    def launch_and_track(self: Any, *args: Any, **kwargs: Any) -> Any:
        stack = _state.__dict__.setdefault("patched", [])
        stack.append(frozenset())  # the launch's own _patch_lang fills it
        try:
            return launch(self, *args, **kwargs)
        finally:
            stack.pop()

    patch_lang_once._skips_nested = True  # type: ignore[attr-defined]
    _originals[:] = [patch_lang, launch]
    interpreter._patch_lang = patch_lang_once
    executor.__call__ = launch_and_track
    return True


def uninstall() -> None:
    """The interpreter as triton ships it again (tests compare the two)."""
    if _originals:
        from triton.runtime import interpreter

        interpreter._patch_lang, interpreter.GridExecutor.__call__ = _originals
        _originals.clear()
