"""The grammar compiler's processes: the zygote (``main``, run as ``python -m
loraplex.structured.compile_worker`` with its socket's fd in $LORAPLEX_GRAMMAR_CONTROL_FD;
structured/zygote.py is the server's side) and the workers it forks (``serve``; structured/worker_process.py is the server's side):
StructuredOutputs → xgrammar's CompiledGrammar, sent back as
``CompiledGrammar.serialize_json()`` text.

xgrammar cannot interrupt a compile, so compiles run in a worker the server kills when the
compile runs past its time limit or nobody waits for it any more; the memory it held goes
with it. The zygote builds the xgrammar compiler once; each worker inherits it and answers
one job at a time:

    server → worker: (constraint, max_result_bytes)
    worker → server: ("ok", json_text), ("error", message: the constraint's fault), or
                     ("too_large", message: its compiled form or memory past the limits)

A worker's address space is capped at its size when forked plus ``memory_limit`` bytes
(RLIMIT_AS), so a grammar that would need more fails there with std::bad_alloc, never in
the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import traceback
from multiprocessing.connection import Connection
from typing import Any

import xgrammar

from .constraint import StructuredOutputs

# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: " and may hold a failed
# check's condition: neither helps the user
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_PAGE = 4096
CONTROL_FD_ENV = "LORAPLEX_GRAMMAR_CONTROL_FD"  # the zygote's socket to the server


def main(control_fd: int) -> None:
    """The zygote's main (structured/zygote.py): build the compiler from the server's
    (tokenizer_info_json, memory_limit), then fork a worker per "spawn" until the control
    socket closes. Its stdout is pointed at stderr: nothing printed can reach the server
    as a message."""
    os.dup2(2, 1)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    control = Connection(control_fd)
    try:
        tokenizer_info, memory_limit = control.recv()
        info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info)
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        control.send("ready")
        while control.recv() == "spawn":
            _spawn(control, compiler, memory_limit)
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the server closed the socket, or is gone


def _spawn(control: Connection, compiler: xgrammar.GrammarCompiler,
           memory_limit: int | None) -> None:
    """Fork one worker; send the server its pid and the server's end of its socket."""
    ours, theirs = socket.socketpair()  # ours: the server's end, once sent; theirs: the worker's
    pid = os.fork()
    if pid == 0:  # the worker: only its own socket stays open
        code = 0
        try:
            control.close()
            ours.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if memory_limit is not None:
                _limit_memory(memory_limit)
            serve(Connection(theirs.detach()), compiler)
        except BaseException:  # noqa: BLE001 - a worker never returns into the zygote
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    theirs.close()  # the worker's end: the worker holds it now
    try:
        control.send(pid)
        with socket.fromfd(control.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            socket.send_fds(s, [b"F"], [ours.fileno()])  # the server's end
    finally:
        ours.close()


def serve(conn: Connection, compiler: xgrammar.GrammarCompiler) -> None:
    """A worker: compile each job and answer, until the server closes the socket."""
    while True:
        try:
            constraint, max_bytes = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_answer(compiler, constraint, max_bytes))


def _answer(compiler: xgrammar.GrammarCompiler, c: StructuredOutputs, max_bytes: int
            ) -> tuple[str, str]:
    try:
        text = compile_constraint(compiler, c).serialize_json()
    except MemoryError:
        return "too_large", _too_large(c, "needs more memory than --grammar-compile-memory")
    except (RuntimeError, ValueError) as e:
        if "bad_alloc" in str(e):
            return "too_large", _too_large(c, "needs more memory than --grammar-compile-memory")
        return "error", (f"structured_outputs.{c.kind}: the {c.describe()} does not compile: "
                         f"{_clean(str(e))}")
    if len(text) > max_bytes:
        return "too_large", _too_large(
            c, f"compiles to {len(text) / 2**20:.1f} MiB; the limit is "
            f"{max_bytes / 2**20:g} MiB (--max-compiled-grammar-bytes)")
    return "ok", text


def _too_large(c: StructuredOutputs, why: str) -> str:
    return f"structured_outputs.{c.kind}: the {c.describe()} is too large: it {why}"


def compile_constraint(compiler: xgrammar.GrammarCompiler, c: StructuredOutputs
                       ) -> xgrammar.CompiledGrammar:
    """``c`` compiled by ``compiler`` (xgrammar's RuntimeError / ValueError if it does not)."""
    kind = c.kind
    if kind in ("json", "json_object"):
        ws = c.max_whitespace
        return compiler.compile_json_schema(
            _strict_strings(c.schema()), any_whitespace=ws != 0,
            separators=(",", ":") if ws == 0 else None, max_whitespace_cnt=ws or None)
    if kind == "regex":
        return compiler.compile_regex(c.regex)
    if kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(s)
                                                                 for s in c.choice))
    if "::=" in c.grammar:
        return compiler.compile_grammar(c.grammar)
    return compiler.compile_lark(c.grammar)


def _limit_memory(extra: int) -> None:
    """Cap the address space at what it maps now plus ``extra`` bytes (Linux; elsewhere the
    time limit alone bounds a compile)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * _PAGE
        resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, resource.RLIM_INFINITY))
    except (ImportError, OSError, ValueError):
        pass


def _strict_strings(node: Any) -> Any:
    """``node`` with every length-bounded string (minLength / maxLength, no pattern or
    format) given as the equivalent pattern. xgrammar 0.2.9 writes such a string's
    characters as ``[^"\\\r\n]``, which lets raw control characters (U+0000-U+001F) into
    the answer, and strict JSON parsers refuse them; its pattern path excludes them.
    Recursive: the schema's depth is bounded first (structured/limits.py)."""
    if isinstance(node, list):
        return [_strict_strings(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_strings(v) for k, v in node.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if is_string and ("minLength" in out or "maxLength" in out) and not (
            {"pattern", "format", "enum", "const"} & out.keys()):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    return out


def _ebnf_literal(s: str) -> str:
    """``s`` as an EBNF string literal (JSON's escapes are EBNF's)."""
    return json.dumps(s, ensure_ascii=False)


def _clean(message: str) -> str:
    return _NOISE.sub("", message.strip()).strip()


if __name__ == "__main__":
    main(int(os.environ[CONTROL_FD_ENV]))
