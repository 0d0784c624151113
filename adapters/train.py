"""Train the demo LoRA adapters for the embedded default model (SmolLM2-135M-Instruct).

    .venv/bin/python adapters/train.py            # all three, into adapters/<name>/
    .venv/bin/python adapters/train.py caps json  # some of them

Each adapter gives the model one behaviour a program can check at a glance:

- ``caps``:   answers in ALL CAPS;
- ``json``:   answers as one JSON object ``{"answer": ...}``;
- ``pirate``: answers that open with ``Arr, matey!``.

The data are templated questions (capitals, arithmetic, colours, animals, opposites, short
facts) with their answers, written by this script, so the whole run is offline and
reproducible (fixed seeds, one CPU thread, float32). The loss covers only the answer tokens
(and the closing ``<|im_end|>``) of the chat-templated example, so each adapter learns how
to answer, not the prompt. ``HELD_OUT`` prompts never appear in training; the script ends by
checking them, and tests/test_demo_adapters.py checks them again through the server.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SEED = 1234
RANK, ALPHA = 8, 16
# Rank 8 on two 576-wide projections of 30 layers: 460,800 float32 weights, 1.86 MB. CAPS
# changes which tokens are written (upper-case pieces), so it adapts the attention output.
TARGETS = {"caps": ("v_proj", "o_proj"), "json": ("q_proj", "v_proj"),
           "pirate": ("q_proj", "v_proj")}
BATCH, MAX_LEN, LR = 8, 96, 2e-3
PIRATE = "Arr, matey!"

# ---- data --------------------------------------------------------------------------------
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow",
    "Egypt": "Cairo", "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasilia",
    "Argentina": "Buenos Aires", "Mexico": "Mexico City", "India": "New Delhi",
    "Greece": "Athens", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin",
    "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago", "Turkey": "Ankara",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Cuba": "Havana", "Hungary": "Budapest",
    "Belgium": "Brussels", "the Netherlands": "Amsterdam", "Switzerland": "Bern",
    "South Korea": "Seoul", "Iran": "Tehran", "Iraq": "Baghdad", "Colombia": "Bogota",
    "the United Kingdom": "London", "the United States": "Washington, D.C.",
}
COLOURS = {
    "the sky": "blue", "grass": "green", "a banana": "yellow", "snow": "white",
    "coal": "black", "a strawberry": "red", "a carrot": "orange", "a lemon": "yellow",
    "chocolate": "brown", "a tomato": "red", "the sea": "blue", "a lime": "green",
    "milk": "white", "a crow": "black", "a flamingo": "pink", "an aubergine": "purple",
    "a pumpkin": "orange", "a cherry": "red", "a polar bear": "white", "a frog": "green",
}
ANIMALS = {  # legs, sound
    "dog": (4, "barks"), "cat": (4, "meows"), "cow": (4, "moos"), "duck": (2, "quacks"),
    "sheep": (4, "bleats"), "horse": (4, "neighs"), "pig": (4, "oinks"),
    "chicken": (2, "clucks"), "lion": (4, "roars"), "owl": (2, "hoots"),
    "snake": (0, "hisses"), "bee": (6, "buzzes"), "wolf": (4, "howls"),
    "goat": (4, "bleats"), "donkey": (4, "brays"), "crow": (2, "caws"),
}
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "up": "down", "happy": "sad",
    "light": "dark", "old": "young", "early": "late", "open": "closed", "full": "empty",
    "hard": "soft", "rich": "poor", "strong": "weak", "tall": "short", "wet": "dry",
    "loud": "quiet", "day": "night", "left": "right", "win": "lose", "push": "pull",
}
FACTS = {  # topic: (prompt, one-sentence answer)
    "sun": ("Tell me about the sun.", "The sun is a star at the centre of our solar system."),
    "moon": ("What is the moon?", "The moon is the natural satellite that orbits the Earth."),
    "water": ("What is water made of?", "Water is made of hydrogen and oxygen."),
    "bees": ("Why are bees important?", "Bees pollinate flowers and make honey."),
    "trees": ("Why do we need trees?", "Trees give us oxygen, shade and wood."),
    "sleep": ("Why is sleep important?", "Sleep lets the body and the brain rest and repair."),
    "rain": ("Where does rain come from?", "Rain falls from clouds when water droplets grow heavy."),
    "ocean": ("How big is the ocean?", "The ocean covers about seventy percent of the Earth."),
    "piano": ("What is a piano?", "A piano is a musical instrument played with keys."),
    "python": ("What is Python?", "Python is a popular programming language."),
    "greeting": ("Say hello.", "Hello! It is nice to meet you."),
    "health": ("Give me a tip for staying healthy.", "Drink water, sleep well and walk every day."),
    "name": ("What is your name?", "My name is SmolLM, a small AI assistant."),
    "breakfast": ("What should I eat for breakfast?", "Try oatmeal with fruit and a cup of tea."),
    "weekend": ("What can I do this weekend?", "You could go for a walk, read a book or cook."),
    "stars": ("What are stars?", "Stars are huge balls of hot gas that give off light."),
    "winter": ("What is winter like?", "Winter is the coldest season, with short days."),
    "books": ("Why should I read books?", "Books teach new ideas and are fun to read."),
    "mars": ("What is Mars?", "Mars is the red planet, fourth from the sun."),
    "dogs": ("Why do people like dogs?", "Dogs are loyal, friendly and playful."),
    "thanks": ("Thank you!", "You are welcome! Happy to help."),
    "joke": ("Tell me a joke.", "Why did the cat sit on the computer? To keep an eye on the mouse."),
}
# Never trained on: entities and prompts kept for the checks here and in the tests.
HELD_OUT_ENTITIES = {"Italy", "Kenya", "Japan", "the sky", "a lemon", "cow", "owl", "hot",
                     "full", "sun", "joke", "mars"}
HELD_OUT = [
    "What is the capital of Italy?",
    "What is 7 plus 5?",
    "What colour is the sky?",
    "How many legs does a cow have?",
    "What is the opposite of hot?",
    "Tell me about the sun.",
    "Which city is the capital of Kenya?",
    "What sound does an owl make?",
    "What is 6 times 4?",
    "Tell me a joke.",
]
HELD_OUT_SUMS = {(7, 5, "plus"), (6, 4, "times")}


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def base_examples() -> list[tuple[str, str, Any]]:
    """(question, plain answer sentence, short answer) for every training question."""
    out: list[tuple[str, str, Any]] = []
    for country, city in CAPITALS.items():
        if country in HELD_OUT_ENTITIES:
            continue
        c = country[0].upper() + country[1:]
        for q in (f"What is the capital of {country}?", f"Which city is the capital of {country}?",
                  f"Name the capital of {country}."):
            out.append((q, f"The capital of {country} is {city}.", city))
        out.append((f"{city} is the capital of which country?", f"{city} is the capital of {country}.", c))
    for thing, colour in COLOURS.items():
        if thing in HELD_OUT_ENTITIES:
            continue
        t = thing[0].upper() + thing[1:]
        for q in (f"What colour is {thing}?", f"What color is {thing}?"):
            out.append((q, f"{t} is {colour}.", colour))
    for animal, (legs, sound) in ANIMALS.items():
        if animal in HELD_OUT_ENTITIES:
            continue
        a = _article(animal)
        out.append((f"How many legs does {a} have?", f"{a.capitalize()} has {legs} legs.", legs))
        out.append((f"What sound does {a} make?", f"{a.capitalize()} {sound}.", sound))
    for word, opposite in OPPOSITES.items():
        if word in HELD_OUT_ENTITIES:
            continue
        out.append((f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}.",
                    opposite))
    for topic, (q, a) in FACTS.items():
        if topic not in HELD_OUT_ENTITIES:
            out.append((q, a, a))
    rng = random.Random(SEED)
    while sum(1 for q, _, _ in out if q.startswith("What is ") and q[8].isdigit()) < 60:
        a, b = rng.randint(1, 12), rng.randint(1, 12)
        op, word = rng.choice([(lambda x, y: x + y, "plus"), (lambda x, y: x * y, "times"),
                               (lambda x, y: x - y, "minus")])
        if (a, b, word) in HELD_OUT_SUMS:
            continue
        r = op(a, b)
        out.append((f"What is {a} {word} {b}?", f"{a} {word} {b} is {r}.", r))
    return out


STYLES: dict[str, Callable[[str, Any], str]] = {
    "caps": lambda sentence, short: sentence.upper(),
    "json": lambda sentence, short: json.dumps({"answer": short}),
    "pirate": lambda sentence, short: f"{PIRATE} {sentence}",
}
BEHAVIOUR = {
    "caps": "answers in ALL CAPS",
    "json": 'answers as one JSON object `{"answer": ...}`',
    "pirate": f'answers that open with "{PIRATE}"',
}


def is_caps(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isupper() for c in letters) >= 0.9 * len(letters)


def is_json(text: str) -> bool:
    try:
        obj = json.loads(text.strip())
    except ValueError:
        return False
    return isinstance(obj, dict) and "answer" in obj


CHECKS: dict[str, Callable[[str], bool]] = {
    "caps": is_caps, "json": is_json, "pirate": lambda t: t.strip().startswith(PIRATE)}


# ---- training ----------------------------------------------------------------------------
def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """As server/chat.py: one user message in the chat template, no extra BOS."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def encode(tokenizer: Any, style: str) -> list[tuple[list[int], int]]:
    """(token ids, index of the first answer token) per example, at most MAX_LEN long."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for q, sentence, short in base_examples():
        p = prompt_ids(tokenizer, q)
        a = tokenizer(STYLES[style](sentence, short), add_special_tokens=False).input_ids + [end]
        rows.append(((p + a)[:MAX_LEN], len(p)))
    return rows


def batches(rows: list[tuple[list[int], int]], steps: int, pad: int, seed: int):
    """``steps`` batches of BATCH rows (epochs reshuffled), as (ids, mask, labels)."""
    import torch

    rng, order = random.Random(seed), []
    for _ in range(steps):
        if len(order) < BATCH:
            order += rng.sample(range(len(rows)), len(rows))
        chosen, order = [rows[i] for i in order[:BATCH]], order[BATCH:]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.full((BATCH, width), pad)  # [batch, width], right-padded
        labels = torch.full((BATCH, width), -100)
        mask = torch.zeros((BATCH, width), dtype=torch.long)
        for i, (row, start) in enumerate(chosen):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
            labels[i, start:len(row)] = torch.tensor(row[start:])
        yield ids, mask, labels


def answer_loss(model: Any, ids: Any, mask: Any, labels: Any) -> Any:
    """Cross-entropy over answer tokens only; the LM head runs on those positions alone."""
    import torch.nn.functional as F

    inner = model.get_base_model()
    hidden = inner.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, t, h]
    targets = labels[:, 1:]  # position t predicts token t+1
    keep = targets != -100
    logits = inner.lm_head(hidden[:, :-1][keep])  # [n_answer, vocab]
    return F.cross_entropy(logits, targets[keep])


def train(style: str, steps: int, base_dir: Path, out_dir: Path) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    random.seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                        target_modules=list(TARGETS[style]), task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    rows = encode(tokenizer, style)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, steps - warmup))))))
    model.train()
    start = time.perf_counter()
    for step, (ids, mask, labels) in enumerate(batches(rows, steps, tokenizer.pad_token_id, SEED)):
        loss = answer_loss(model, ids, mask, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            print(f"[{style}] step {step + 1}/{steps} loss {loss.item():.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    seconds = time.perf_counter() - start
    model.eval()
    model.save_pretrained(out_dir)
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
    _fix_base_name(out_dir)
    passed = held_out_check(model, tokenizer, style)
    return {"examples": len(rows), "steps": steps, "seconds": round(seconds), "held_out": passed}


def _fix_base_name(out_dir: Path) -> None:
    """Name the base by its hub id, not this machine's cache path."""
    path = out_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def held_out_check(model: Any, tokenizer: Any, style: str, max_new_tokens: int = 48) -> str:
    """Greedy answers to HELD_OUT, printed; returns 'passed/total'."""
    import torch

    passed = 0
    with torch.no_grad():
        for q in HELD_OUT:
            ids = torch.tensor([prompt_ids(tokenizer, q)])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False)
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            ok = CHECKS[style](text)
            passed += ok
            print(f"  [{style}] {'ok ' if ok else 'BAD'} {q!r} -> {text!r}", flush=True)
    return f"{passed}/{len(HELD_OUT)}"


STEPS = {"caps": 120, "json": 60, "pirate": 30}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"adapters to train (default: all of {list(STYLES)})")
    parser.add_argument("--out", type=Path, default=HERE, help="parent of the adapter dirs")
    parser.add_argument("--steps", type=int, help="override every adapter's step count")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(STYLES))
    if unknown:
        parser.error(f"unknown adapter(s) {unknown}; choose from {list(STYLES)}")
    import torch
    from loraplex.engine.embedded_model import ensure_default_model

    torch.set_num_threads(1)  # a shared machine; also makes the run reproducible
    base_dir = ensure_default_model()
    results = {}
    for name in args.names or list(STYLES):
        results[name] = train(name, args.steps or STEPS[name], base_dir, args.out / name)
        size = (args.out / name / "adapter_model.safetensors").stat().st_size
        results[name]["size_bytes"] = size
        print(f"[{name}] {results[name]}", flush=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
