"""Where an activated LoRA (PEFT's aLoRA, ``alora_invocation_tokens``) starts to apply.

PEFT's rule (``peft.tuners.lora.variants.calculate_alora_offsets``, computed once from the
prompt): the adapter's delta applies from the first token of the LAST occurrence of its
invocation sequence in the prompt on, and to every generated token; the tokens before it
are computed as by the base model, so their KV is the base model's. A prompt without the
invocation sequence runs the base model throughout (PEFT's offset None), generated tokens
included: ``NEVER``. PEFT masks the whole LoRA delta there (lora_B's bias with it), so such a
request needs nothing of its adapter on the device (``needs_adapter``): it is scheduled and
cached as a base request. An adapter's own token rows (modules_to_save, trainable tokens) are
not LoRA layers: PEFT applies them whatever the invocation, from position 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

NEVER = sys.maxsize  # an activation position no sequence reaches: the base model throughout


def activation_start(prompt: Sequence[int], invocation: Sequence[int] | None) -> int:
    """The first position the adapter's delta applies to: 0 for a plain adapter
    (``invocation`` None), the start of the last occurrence of ``invocation`` in
    ``prompt``, or NEVER when the prompt does not hold it."""
    if not invocation:
        return 0
    k, first = len(invocation), invocation[0]
    wanted = list(invocation)
    for i in range(len(prompt) - k, -1, -1):  # from the end: the last occurrence wins
        if prompt[i] == first and list(prompt[i:i + k]) == wanted:
            return i
    return NEVER


def needs_adapter(start: int, has_token_rows: bool) -> bool:
    """Whether a request whose adapter applies from ``start`` needs the adapter's weights
    (a device slot) at all: not for an activated LoRA never invoked (NEVER), unless the
    adapter has its own token rows, which apply whatever the invocation."""
    return start != NEVER or has_token_rows
