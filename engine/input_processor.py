"""InputProcessor: the one place a request is checked, tokenized and turned into an
EngineRequest, a frozen value the engine thread only adds. vLLM v1's ``Processor`` is the
model (``process_inputs``: every check, the LoRA request's, the structured output's, once,
into an immutable ``EngineCoreRequest``).

The fronts (gRPC ``Inference``, HTTP ``/v1/completions`` and ``/v1/chat/completions``, the
Python API ``LLMEngine`` / ``AsyncEngine``) only translate their fields into a
``RequestInput``; ``process`` then runs, in this order and each once:
1. the model's defaults for unset fields (generation_config.json);
2. the caps on the list fields (engine/request_checks.py: cheap, so they bound the rest);
3. ``SamplingParams.validate`` (ranges that need no engine);
4. the prompt: tokenized, not empty, ids in the vocabulary, shorter than max_model_len;
5. ``max_new_tokens`` against the room the prompt leaves (vLLM's words on HTTP), and
   ``min_new_tokens`` within it;
6. the fields against the engine (stop_token_ids, --max-logprobs, --max-num-seqs,
   logit_bias / allowed_token_ids in the vocabulary) and bad_words tokenized;
7. the constraint's limits (engine/constraints.py; compiles nothing);
8. the adapter: one lookup of the name (NOT_FOUND if unknown), and where its delta starts
   to apply in the prompt (an activated LoRA's invocation: engine/activation.py).
An adapter that brings its own tokenizer (lora/adapter_vocab.py) has its request
tokenized with it, and its vocabulary (the base's plus the added tokens) is the one steps
4 and 6 check against; ``EngineRequest.tokenizer`` carries it to the detokenizer. With
lora_scale 0 (the base model's rows) the vocabulary is the base's. Structured outputs on
such an adapter are refused (the grammar compiler holds the base's tokenizer).
Only a request that passed all of them asks for its grammar (``compile`` /
``compile_async``): the compile is requested last (vLLM's ``grammar_init`` too), and the
bounded compiler (structured/) keeps its limits, pending cap (429) and worker processes.

Why a thread (``run``): tokenizing a long prompt or rendering a chat template takes
milliseconds to seconds of CPU. On the asyncio loop it stalls both fronts (health probes
and every other request's stream wait); on the engine thread it stalls every running
sequence's step. A front's translation and ``process`` run together in one call on the
processor's one thread: one hop there and back.

Invariants:
- one worker thread, so requests are prepared in arrival order and the tokenizer is used
  by one preparing thread at a time (vLLM's tokenizer executor has one worker too);
- the worker starts with ``intra_op.serial_thread``: a check may run a torch op, and it
  must never start an OpenMP pool (kernel_backends/intra_op.py);
- nothing here touches the engine's mutable state: it reads the model, the config, the
  tokenizer and one dict lookup of the adapter name, and of its load's meta (safe beside
  the engine thread); the
  engine thread adds the request (``LLMEngine.add_sequence``), which binds the adapter to
  its newest load in place;
- an EngineRequest and its SamplingParams are frozen: nothing downstream changes them.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from ..errors import AdapterNotFoundError, InvalidRequestError
from ..kernel_backends import intra_op
from ..lora.adapter_vocab import AdapterVocab
from .activation import activation_start
from .bad_words import BadWords
from .constraints import Constraints
from .engine_config import EngineConfig
from .request_checks import check_limits, check_sampling, check_vocab, tokenize_bad_words
from .sampling_params import SamplingParams

T = TypeVar("T")

Prompt = str | list[int]  # text, or token ids (the one alias: server/prompt.py uses it)

THREAD_NAME = "loraplex-request"


@dataclass(frozen=True)
class RequestInput:
    """A request as a front translated it; nothing checked yet."""

    prompt: Prompt
    params: SamplingParams | None = None  # None: every field the model's default
    adapter: str | None = None  # None, "" or a base model name: the base model
    request_id: str | None = None  # None: the processor names it
    # the front's name for max_new_tokens (HTTP: "max_tokens" / "max_completion_tokens"):
    # given, a max_new_tokens past the context is refused in vLLM's words, with that name
    max_tokens_field: str | None = None
    # a front that loads unknown names on first use (--lora-resolver-dir): an unknown
    # adapter comes back unbound (adapter_id None) for the front to load, then ``bind``
    may_resolve: bool = False


@dataclass(frozen=True)
class EngineRequest:
    """A checked request: what the engine thread adds (``LLMEngine.add_request``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # the model's defaults filled in, checked; max_new_tokens set
    adapter_name: str | None  # None = the base model
    adapter_id: int | None  # 0 = the base model; None = unknown, to be resolved (bind)
    max_tokens: int  # prompt + generated never exceeds this
    bad_words: BadWords | None = None  # params.bad_words, tokenized and indexed
    # the first position the adapter's delta applies to (activation.py: an activated LoRA's
    # invocation start), for load ``adapter_id``: add_sequence recomputes it only if a load
    # in place moved the request to another load
    adapter_start: int = 0
    grammar: object | None = None  # the compiled constraint, attached last
    tokenizer: Any = None  # the adapter's own tokenizer (adapter_vocab.py); None: the engine's


class EngineView(Protocol):
    """What the InputProcessor reads of the LLMEngine (read-only; the tokenizer is read at
    each request, so a swapped one is used at once)."""

    config: EngineConfig
    base: Any  # BaseModel: hf_config.vocab_size, sampling_defaults
    tokenizer: Any
    max_model_len: int
    lora: Any  # AdapterCache: names, lookup
    constraints: Constraints

    def is_base_model(self, name: str | None) -> bool: ...

    def unknown_adapter(self, name: str) -> AdapterNotFoundError: ...


class InputProcessor:
    def __init__(self, engine: EngineView):
        self.engine = engine  # read-only here: model, config, tokenizer, adapter names
        self._ids = itertools.count()
        self._pool: ThreadPoolExecutor | None = None

    # ---- the checks -------------------------------------------------------------------
    def process(self, inp: RequestInput) -> EngineRequest:
        """Every check of ``inp`` (the order of the module's docstring), its prompt
        tokenized, its adapter looked up: InvalidRequestError naming the field,
        AdapterNotFoundError for an unknown adapter. Compiles nothing (``compile``)."""
        engine, config = self.engine, self.engine.config
        params = (inp.params or SamplingParams()).with_defaults(engine.base.sampling_defaults)
        own = self.own_vocabulary(inp.adapter)
        tokenizer = engine.tokenizer if own is None else own.tokenizer
        vocab = own.size if own is not None and params.lora_scale else \
            engine.base.hf_config.vocab_size
        check_limits(params, config, vocab)  # first: the lists' lengths bound the rest
        try:
            params.validate()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        ids = self.tokenize(inp.prompt, tokenizer)
        self._check_prompt(ids, vocab)
        max_new = self._max_new_tokens(inp, params, len(ids))
        check_vocab(params.stop_token_ids, "stop_token_ids", vocab)
        resolved = check_sampling(params, config, vocab)
        bad_words = tokenize_bad_words(tokenizer, params.bad_words, vocab)
        if own is not None and params.structured_outputs is not None:
            raise InvalidRequestError(
                f"structured outputs are not served on adapter {inp.adapter!r}: it brings its "
                "own tokenizer, and grammars are compiled for the base model's")
        engine.constraints.check(params)  # the constraint's limits; compiles nothing
        params = replace(params, **resolved, max_new_tokens=max_new,
                         temperature=1.0 if params.temperature is None else params.temperature)
        adapter_name, adapter_id = self._adapter(inp)  # last: the one lookup
        return EngineRequest(
            request_id=inp.request_id if inp.request_id is not None else
            f"req-{next(self._ids)}", prompt_token_ids=ids, params=params,
            adapter_name=adapter_name, adapter_id=adapter_id, max_tokens=len(ids) + max_new,
            bad_words=bad_words, adapter_start=self.adapter_start(ids, adapter_id),
            tokenizer=None if own is None else own.tokenizer)

    def own_vocabulary(self, adapter: str | None) -> AdapterVocab | None:
        """The registered adapter ``adapter``'s own tokenizer and vocabulary, if it brings
        one (None: the base model's; a dict read, safe beside the engine thread)."""
        if self.engine.is_base_model(adapter):
            return None
        cached = self.engine.lora.names.get(adapter)
        return None if cached is None else cached.meta.vocab

    def tokenizer_for(self, adapter: str | None) -> Any:
        """The tokenizer requests on ``adapter`` are tokenized and detokenized with."""
        own = self.own_vocabulary(adapter)
        return self.engine.tokenizer if own is None else own.tokenizer

    def tokenize(self, prompt: Prompt, tokenizer: Any = None) -> list[int]:
        """``prompt``'s ids: text tokenized with ``tokenizer`` (None: the engine's)."""
        if isinstance(prompt, str):
            tokenizer = tokenizer if tokenizer is not None else self.engine.tokenizer
            if tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: give prompt_token_ids")
            return list(tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    def _check_prompt(self, ids: list[int], vocab: int) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        check_vocab(ids, "the prompt", vocab)
        max_model_len = self.engine.max_model_len
        if len(ids) >= max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; max_model_len is {max_model_len}, so a "
                f"prompt may have at most {max_model_len - 1}")

    def _max_new_tokens(self, inp: RequestInput, params: SamplingParams, prompt_len: int
                        ) -> int:
        """The new tokens the request may have: ``max_new_tokens``, or the room the prompt
        leaves; InvalidRequestError when it does not fit (HTTP: in vLLM's words, naming the
        front's field) or ``min_new_tokens`` cannot be reached."""
        max_model_len = self.engine.max_model_len
        room = max_model_len - prompt_len
        max_new = params.max_new_tokens if params.max_new_tokens is not None else room
        if max_new > room:
            given = inp.params is not None and inp.params.max_new_tokens is not None
            name = inp.max_tokens_field if given else None
            if name is not None:
                raise InvalidRequestError(
                    f"{name}={max_new} is too large: this model's maximum context length is "
                    f"{max_model_len} tokens and the request has {prompt_len} input tokens "
                    f"({max_new} > {max_model_len} - {prompt_len})")
            raise InvalidRequestError(
                f"max_new_tokens={max_new} does not fit: the prompt has {prompt_len} tokens "
                f"and max_model_len is {max_model_len}, so at most {room} new tokens")
        if params.min_new_tokens > max_new:
            raise InvalidRequestError(
                f"min_new_tokens={params.min_new_tokens} cannot be reached: the prompt has "
                f"{prompt_len} tokens and max_model_len is {max_model_len}, so at most "
                f"{max_new} new tokens")
        return max_new

    def _adapter(self, inp: RequestInput) -> tuple[str | None, int | None]:
        """(name, id) of the request's adapter, (None, 0) for the base model; the one
        lookup of the name (a dict read: safe beside the engine thread)."""
        name = inp.adapter
        if self.engine.is_base_model(name):
            return None, 0
        assert name is not None
        if name in self.engine.lora.names:
            return name, self.engine.lora.lookup(name)
        if inp.may_resolve:
            return name, None
        raise self.engine.unknown_adapter(name)

    def bind(self, request: EngineRequest) -> EngineRequest:
        """``request`` with its adapter's id, once a resolver has loaded it (NOT_FOUND if it
        is still unknown)."""
        name = request.adapter_name
        assert name is not None
        if name not in self.engine.lora.names:
            raise self.engine.unknown_adapter(name)
        adapter_id = self.engine.lora.lookup(name)
        if self.own_vocabulary(name) is not None:  # checked with the base's tokenizer
            raise InvalidRequestError(
                f"adapter {name!r} brings its own tokenizer and was loaded by this request, "
                "which was tokenized before with the base model's: send it again")
        return replace(request, adapter_id=adapter_id,
                       adapter_start=self.adapter_start(request.prompt_token_ids, adapter_id))

    def adapter_start(self, ids: list[int], adapter_id: int | None) -> int:
        """Where load ``adapter_id``'s delta starts to apply in a request of prompt ``ids``
        (activation.py: 0 but for an activated LoRA); a dict read of the load's meta (safe
        beside the engine thread), once per request, off the engine thread."""
        adapter = self.engine.lora.by_id.get(adapter_id) if adapter_id else None
        return 0 if adapter is None else activation_start(ids, adapter.meta.invocation_tokens)

    # ---- the grammar, last --------------------------------------------------------------
    def compile(self, request: EngineRequest) -> EngineRequest:
        """``request`` with its grammar compiled (blocking; a free request as it is)."""
        if request.params.structured_outputs is None:
            return request
        return replace(request, grammar=self.engine.constraints.compile(request.params))

    async def compile_async(self, request: EngineRequest) -> EngineRequest:
        """``compile`` for an event loop: the compile runs in a worker process while the
        loop runs on (never on the processor's or the engine's thread)."""
        if request.params.structured_outputs is None:
            return request
        grammar = await self.engine.constraints.compile_async(request.params)
        return replace(request, grammar=grammar)

    # ---- the thread ---------------------------------------------------------------------
    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the processor's thread, awaited from the loop: a
        front's translation with ``process`` in one call (one hop), or a tokenizing."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME,
                                            initializer=intra_op.serial_thread)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Stop the thread (a later ``run`` starts a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
