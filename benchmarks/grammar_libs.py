"""llguidance against xgrammar on our tokenizers: how the grammar library was chosen.

    .venv/bin/pip install llguidance  # the library not chosen is no dependency
    .venv/bin/python -m loraplex.benchmarks.grammar_libs [--out FILE.md]

For each library and tokenizer (the embedded SmolLM2's, 49,152 tokens, and the tests' tiny
byte-level BPE) and each constraint of the checks (tests/structured_fixtures.py: eight JSON
schemas, a regex, a choice, a small grammar), in compact JSON and in bounded whitespace
(at most 4 whitespace characters per gap, the engine's default): the compile time of the
constraint (no cache), then a valid answer walked token by token, timing the fill of the
next-token bitmask before each token (one matcher, on this thread). Also the time to apply
a [32, 49152] bitmask to float32 logits with each library's CPU helper. Prints a Markdown
report (library versions, ISA).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..tests import structured_fixtures as cases
from .common import default_model_dir, machine_line

WS_BOUND = 4
WS = rf"[\x20\x0A\x0D\x09]{{0,{WS_BOUND}}}"


@dataclass
class Walk:
    compile_ms: list[float] = field(default_factory=list)
    first_mask_us: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)  # every mask after the first
    failures: list[str] = field(default_factory=list)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def wide_schema(n: int = 40) -> tuple[dict, dict]:
    """A tool-call-sized schema (``n`` required fields of every kind) and an instance."""
    kinds = [({"type": "string", "maxLength": 16}, "text"),
             ({"type": "integer", "minimum": -1000, "maximum": 1000}, -17),
             ({"enum": ["red", "green", "blue", "cyan"]}, "blue"),
             ({"type": "boolean"}, False),
             ({"type": "array", "items": {"type": "integer"}, "maxItems": 4}, [1, 2]),
             ({"type": "object", "additionalProperties": False, "required": ["x", "y"],
               "properties": {"x": {"type": "number"}, "y": {"type": "string",
                                                            "pattern": "^[a-z]+$"}}},
              {"x": 1.5, "y": "ok"})]
    props = {f"field_{i}": kinds[i % len(kinds)][0] for i in range(n)}
    value = {f"field_{i}": kinds[i % len(kinds)][1] for i in range(n)}
    return ({"type": "object", "additionalProperties": False, "properties": props,
             "required": list(props)}, value)


def constraints() -> list[tuple[str, str, object, str]]:
    """(name, kind, spec, answer text)."""
    out = [(name, "json", schema, cases.compact(value)) for name, schema, value in cases.SCHEMAS]
    wide, value = wide_schema()
    out.append(("wide", "json", wide, cases.compact(value)))
    out += [("regex", "regex", cases.REGEX, cases.REGEX_ANSWER),
            ("choice", "choice", cases.CHOICES, cases.CHOICES[2]),
            ("grammar", "grammar", None, cases.GRAMMAR_ANSWER)]
    return out


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.mask = llguidance.numpy.allocate_token_bitmask(1, vocab)

    @staticmethod
    def version() -> str:
        import llguidance

        return llguidance.get_version()

    def grammar(self, kind: str, spec: object, bounded: bool) -> str:
        m = self.llg.LLMatcher
        if kind == "json":
            opts = {"whitespace_flexible": bounded, "item_separator": ",", "key_separator": ":"}
            if bounded:
                opts["whitespace_pattern"] = WS
            return m.grammar_from_json_schema(spec, defaults=opts)
        if kind == "regex":
            return m.grammar_from_regex(spec)
        if kind == "choice":
            return self.llg.grammar_from("choice", spec)
        return m.grammar_from_lark(cases.GRAMMAR)

    def compile(self, kind: str, spec: object, bounded: bool):
        matcher = self.llg.LLMatcher(self.tok, self.grammar(kind, spec, bounded), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher) -> None:
        self.np.fill_next_token_bitmask(matcher, self.mask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def eos_ok(self, matcher) -> bool:
        return matcher.is_accepting()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    @staticmethod
    def version() -> str:
        from importlib.metadata import version

        return f"xgrammar@{version('xgrammar')}"

    def compile(self, kind: str, spec: object, bounded: bool):
        c = self.compiler
        if kind == "json":
            g = c.compile_json_schema(spec, any_whitespace=bounded, separators=(",", ":"),
                                      max_whitespace_cnt=WS_BOUND if bounded else None)
        elif kind == "regex":
            g = c.compile_regex(spec)
        elif kind == "choice":
            g = c.compile_grammar(" | ".join(f'"{s}"' for s in spec).join(["root ::= ", ""]))
        else:
            g = c.compile_grammar(cases.GRAMMAR_EBNF)
        return self.xgr.GrammarMatcher(g)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.mask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def eos_ok(self, matcher) -> bool:
        return matcher.accept_token(matcher.stop_token_ids[0])


def walk(lib, tokenizer, bounded: bool, repeats: int) -> Walk:
    w = Walk()
    for name, kind, spec, answer in constraints():
        ids = tokenizer(answer, add_special_tokens=False).input_ids
        for _ in range(repeats):
            t = time.perf_counter()
            matcher = lib.compile(kind, spec, bounded)
            w.compile_ms.append((time.perf_counter() - t) * 1e3)
            for i, token in enumerate(ids):
                t = time.perf_counter()
                lib.fill(matcher)
                (w.first_mask_us if i == 0 else w.mask_us).append(
                    (time.perf_counter() - t) * 1e6)
                if not lib.accept(matcher, token):
                    w.failures.append(f"{name}: token {i} of {answer!r} refused")
                    break
            else:
                t = time.perf_counter()
                lib.fill(matcher)  # the mask that must allow EOS
                w.mask_us.append((time.perf_counter() - t) * 1e6)
                if not lib.eos_ok(matcher):
                    w.failures.append(f"{name}: EOS refused after {answer!r}")
    return w


def torch_apply(logits: torch.Tensor, mask: torch.Tensor) -> None:
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [B, W, 32]
    logits.masked_fill_(bits.view(mask.shape[0], -1)[:, :logits.shape[1]] == 0, float("-inf"))


def apply_times(vocab: int = 49152, batch: int = 32, repeats: int = 50) -> dict[str, float]:
    """µs to apply a [batch, vocab] bitmask to float32 logits, per library helper."""
    import llguidance.numpy
    import xgrammar

    rng = np.random.default_rng(0)
    mask = torch.from_numpy(rng.integers(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32),
                                         dtype=np.int32))
    logits = torch.randn(batch, vocab)
    helpers: dict[str, Callable[[], None]] = {
        "xgrammar.apply_token_bitmask_inplace (cpu kernel)":
            lambda: xgrammar.apply_token_bitmask_inplace(logits, mask),
        "llguidance.numpy.apply_token_bitmask_inplace":
            lambda: llguidance.numpy.apply_token_bitmask_inplace(logits.numpy(), mask.numpy()),
        "torch ops (unpack the bits, masked_fill_)": lambda: torch_apply(logits, mask),
    }
    out = {}
    for name, fn in helpers.items():
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="walks of each constraint")
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = {
            "SmolLM2 (49,152)": (AutoTokenizer.from_pretrained(default_model_dir()), 49152),
            "tiny byte BPE (384)": (AutoTokenizer.from_pretrained(
                cases.make_byte_tokenizer(Path(tmp) / "tok")), 384),
        }
    libs = (LLGuidance, XGrammar)
    lines = ["# Grammar libraries on our tokenizers", "",
             (f"Machine: {machine_line('-', 'float32')}; "
              f"{', '.join(lib.version() for lib in libs)}; one thread fills one mask."), "",
             ("| library | tokenizer | whitespace | tokenizer set-up ms | compile ms p50 / max "
              "| first mask µs p50 / max | mask µs mean / p50 / p99 / max | failures |"),
             "|---|---|---|---|---|---|---|---|"]
    failures = []
    for lib_cls in libs:
        for tok_name, (tok, vocab) in tokenizers.items():
            t = time.perf_counter()
            lib = lib_cls(tok, vocab)
            setup = (time.perf_counter() - t) * 1e3
            for bounded in (False, True):
                w = walk(lib, tok, bounded, args.repeats)
                failures += [f"{lib.name}/{tok_name}: {f}" for f in w.failures]
                lines.append(
                    f"| {lib.name} | {tok_name} | {'bounded' if bounded else 'compact'} "
                    f"| {setup:.0f} | {_pct(w.compile_ms, 50):.2f} / {max(w.compile_ms):.1f} "
                    f"| {_pct(w.first_mask_us, 50):.0f} / {max(w.first_mask_us):.0f} "
                    f"| {statistics.fmean(w.mask_us):.0f} / {_pct(w.mask_us, 50):.0f} / "
                    f"{_pct(w.mask_us, 99):.0f} / "
                    f"{max(w.mask_us):.0f} | {len(w.failures)} |")
    lines += ["", "Applying a [32, 49152] bitmask to float32 logits on the CPU (median µs):", ""]
    lines += [f"- {name}: {us:.0f} µs" for name, us in apply_times().items()]
    if failures:
        lines += ["", "Failures:", ""] + [f"- {f}" for f in failures]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
