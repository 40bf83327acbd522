"""lm-evaluation-harness against dsv4, and against HF transformers on the same checkpoint.

A small local task set (written here; no network): a multiple-choice loglikelihood task, a
rolling-loglikelihood (perplexity) task and a greedy `generate_until` task. lm-eval runs it through
`local-completions` against a dsv4 server (echo + logprobs for the loglikelihoods) and through its
HF backend (`DeepseekV4ForCausalLM.from_pretrained` on the tiny checkpoint). Per-example
loglikelihoods agree within 1e-3 (fp32; the server's indexer keys in fp32, as HF keeps them), the
greedy generations are identical and so are the scores.
"""

from __future__ import annotations

import json
import math
import random

import pytest
from live_server import LiveServer, live_servers

lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-3
WORDS = ["red", "blue", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "one", "two"]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_tasks(root) -> list[str]:
    rng = random.Random(0)
    data = {
        "mc": [{"question": _sentence(rng, 6) + ":", "choices": [_sentence(rng, 2) for _ in range(3)],
                "label": rng.randrange(3)} for _ in range(6)],
        "ppl": [{"text": _sentence(rng, rng.randint(8, 40))} for _ in range(4)],
        "gen": [{"prompt": _sentence(rng, 5), "answer": _sentence(rng, 1)} for _ in range(4)],
    }
    configs = {
        "mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
               "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]},
        "ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                                {"metric": "bits_per_byte"}]},
        "gen": {"output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
                "generation_kwargs": {"until": ["\n\n"], "do_sample": False, "max_gen_toks": 8},
                "metric_list": [{"metric": "exact_match"}]},
    }
    names = []
    for kind, rows in data.items():
        name = f"dsv4_tiny_{kind}"
        path = root / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}},
                  "test_split": "test", **configs[kind]}
        (root / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML
        names.append(name)
    return names


def evaluate(model: str, model_args: str, tasks: list[str], include: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=TaskManager(include_path=include),
                           log_samples=True, batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                           fewshot_random_seed=0)


def responses(result: dict, task: str) -> list:
    """Per example (in doc order), the model's raw answers: (loglikelihood, greedy) pairs or texts."""
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [[r[0] for r in s["resps"]] for s in samples]


def test_lm_eval_local_completions_matches_hf(tiny_ckpt, tmp_path, monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    tasks = write_tasks(tasks_dir)
    server = LiveServer(tiny_ckpt, tmp_path / "server.log", "--index-key-dtype", "fp32", "--served-model-name", "tiny")
    with live_servers(server):
        served = evaluate("local-completions",
                          f"base_url={server.base}/v1/completions,model=tiny,tokenizer_backend=huggingface,"
                          f"tokenizer={tiny_ckpt},max_retries=1,timeout=60", tasks, str(tasks_dir))
    reference = evaluate("hf", f"pretrained={tiny_ckpt},dtype=float32,device=cpu", tasks, str(tasks_dir))

    worst = 0.0
    for task in tasks:
        ours, theirs = responses(served, task), responses(reference, task)
        assert len(ours) == len(theirs) > 0, task
        for doc, (mine, hf) in enumerate(zip(ours, theirs, strict=True)):
            if task.endswith("gen"):
                assert mine == hf, f"{task} doc {doc}: {mine!r} != {hf!r}"
                continue
            for answer, hf_answer in zip(mine, hf, strict=True):
                # multiple choice: (loglikelihood, is_greedy); rolling: the loglikelihood alone
                (ll, *greedy), (hf_ll, *hf_greedy) = _pair(answer), _pair(hf_answer)
                worst = max(worst, abs(ll - hf_ll))
                assert math.isfinite(ll) and abs(ll - hf_ll) < TOLERANCE, f"{task} doc {doc}: {ll} vs {hf_ll}"
                assert greedy == hf_greedy, f"{task} doc {doc}: is_greedy {greedy} vs {hf_greedy}"
        ours, theirs = _scores(served, task), _scores(reference, task)
        assert ours.keys() == theirs.keys() and ours, task
        for metric, value in ours.items():
            # acc and exact_match are counts: equal; perplexities follow the loglikelihoods' 1e-3
            exact = metric.startswith(("acc", "exact_match"))
            assert value == theirs[metric] if exact else math.isclose(value, theirs[metric], rel_tol=TOLERANCE), (
                f"{task} {metric}: {value} vs {theirs[metric]}")
    print(f"largest loglikelihood difference from HF: {worst:.2e}; scores {[_scores(served, t) for t in tasks]}; "
          f"generations {responses(served, tasks[-1])}")


def _pair(answer) -> tuple:
    return tuple(answer) if isinstance(answer, list | tuple) else (answer,)


def _scores(result: dict, task: str) -> dict[str, float]:
    """The task's metric values (not their stderr or alias)."""
    return {k: v for k, v in result["results"][task].items() if "stderr" not in k and isinstance(v, int | float)}
