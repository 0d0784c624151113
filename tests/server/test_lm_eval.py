"""lm-evaluation-harness as the client: a small local multiple-choice task scored through
``local-completions`` against a real server (echo, logprobs=1, max_tokens=1, then
``token_logprobs[ctxlen:-1]``) gives the same accuracy and the same loglikelihood per
choice as lm-eval's own ``hf`` model with the PEFT adapter, the oracle."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

lm_eval = pytest.importorskip("lm_eval")  # the dev extra: lm-eval[api]

TASK = "loraplex_tiny_mc"
DOCS = [  # words of the tiny tokenizer (tests/conftest.py WORDS)
    ("the cat is on the", ["table", "river", "dog"], 0),
    ("paris is the capital of", ["france", "sql", "json"], 0),
    ("select the name from the", ["table", "cat", "one"], 0),
    ("the dog and the", ["cat", "query", "five"], 0),
    ("one two three", ["four", "city", "adapter"], 0),
    ("the model gives an", ["answer", "river", "avg"], 0),
]


def _write_task(root: Path) -> Path:
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in DOCS))
    (root / f"{TASK}.yaml").write_text("\n".join([
        f"task: {TASK}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {data}",
        "test_split: test",
        "output_type: multiple_choice",
        "doc_to_text: '{{question}}'",
        "doc_to_choice: choices",
        "doc_to_target: answer",
        "metric_list:",
        "  - metric: acc",
        "",
    ]))
    return root


def _evaluate(model: str, model_args: str, tasks_dir: Path) -> tuple[float, list]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # only this file's task: lm-eval's ~14,000 built-in task files are not indexed (~35 s
    # on 2 cores, each evaluation)
    tasks = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    out = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=tasks,
                          log_samples=True, batch_size=1)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return out["results"][TASK]["acc,none"], lls


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, tiny_adapters: Callable[[str], Path]) -> Any:
    return serve(lambda: make_engine(tiny_llama, lora_modules={"a": str(tiny_adapters("a0"))}),
                 http_port=0)


def test_local_completions_equals_hf_with_peft(server: Any, tiny_llama: Path,
                                               tiny_adapters: Callable[[str], Path],
                                               tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = _write_task(tmp_path)
    served_acc, served = _evaluate(
        "local-completions",
        f"model=a,base_url={server.http_url}/v1/completions,tokenizer={tiny_llama},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=256", tasks)
    hf_acc, oracle = _evaluate(
        "hf", f"pretrained={tiny_llama},peft={tiny_adapters('a0')},dtype=float32,device=cpu",
        tasks)
    assert served_acc == hf_acc
    assert len(served) == len(DOCS) and all(len(s) == 3 for s in served)
    flat = [ll for doc in served for ll in doc]
    assert all(ll < 0 for ll in flat) and len({round(ll, 3) for ll in flat}) > len(DOCS)
    for mine, theirs in zip(served, oracle):
        assert mine == pytest.approx(theirs, abs=1e-3)
