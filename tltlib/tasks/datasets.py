"""Problems from anywhere: the task registry (``chain``, ``words``), dataset files (JSONL and verl-style parquet, with
refusals that name the file, row and field), seeded train/held-out splits, and responses files of token ids.

Paper: TLT §2 and §7 (Eurus-2-RL math/code prompts; here any GSM8K/MATH-style JSONL or verl parquet).

Departures:
1. A dataset row is scored by the shared answer extraction of :mod:`tltlib.tasks.problem` (``#### x``,
   ``\\boxed{x}``, ``#x``) rather than a per-dataset verifier.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import BadInput, NotFound
from ..fileio import atomic_file, resolve
from .chain import ChainTaskConfig, generate_problems
from .problem import Problem, extract_answer, normalize_answer
from .wordproblems import WordTaskConfig, generate_word_problems

_PROMPT_KEYS = ("prompt", "question", "problem")
_ANSWER_KEYS = ("ground_truth", "answer", "solution")
_WORD_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")   # a plain word (not a LaTeX command such as \sqrt)


def _row_to_problem(row: dict, where: str) -> Problem:
    prompt = next((row[k] for k in _PROMPT_KEYS if row.get(k) is not None), None)
    if prompt is None:
        raise BadInput(f"{where}: no prompt field (expected one of {', '.join(_PROMPT_KEYS)})")
    if hasattr(prompt, "tolist"):                               # parquet gives numpy arrays of dicts
        prompt = prompt.tolist()
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and "content" in m for m in prompt):
            raise BadInput(f"{where}: field 'prompt' is a list but not chat messages "
                           "[{'role': ..., 'content': ...}, ...]")
        if not all(isinstance(m["content"], str) for m in prompt) or not any(m["content"].strip() for m in prompt):
            raise BadInput(f"{where}: the chat messages' 'content' must be strings, not all empty")
        prompt = tuple({"role": m.get("role", "user"), "content": m["content"]} for m in prompt)
    elif not isinstance(prompt, str) or not prompt.strip():
        raise BadInput(f"{where}: field 'prompt' must be a non-empty string or a list of chat messages")
    rm = row.get("reward_model") or {}
    truth = rm.get("ground_truth") if isinstance(rm, dict) else None
    key = "reward_model.ground_truth"
    if truth is None:
        key = next((k for k in _ANSWER_KEYS if row.get(k) is not None), None)
        truth = row.get(key) if key else None
    if truth is None:
        raise BadInput(f"{where}: no ground truth (expected reward_model.ground_truth or one of "
                       f"{', '.join(_ANSWER_KEYS)})")
    truth = str(truth)
    if key in ("answer", "solution") and ("####" in truth or "\\boxed" in truth):
        truth = extract_answer(truth)                          # GSM8K "... #### 72", MATH "... \boxed{3}"
    elif truth.strip() and not _scoreable(truth):
        raise NotAnAnswer(f"{key!r}: {truth[:60]!r}")          # no response's final answer could equal it
    if not truth:
        raise BadInput(f"{where}: field {key!r} holds an empty ground truth")
    meta = {k: v for k, v in row.items() if k in ("data_source", "ability", "extra_info", "steps", "level", "source")}
    response = row.get("response", row.get("completion"))
    if isinstance(response, str) and response.strip():
        meta["response"] = response                            # a reference response (drafter training data)
    return Problem(prompt, normalize_answer(truth), meta)


def _scoreable(truth: str) -> bool:
    """Whether a response can earn the reward for the ground truth ``truth``: the final answer the reward reads
    (:func:`~tltlib.tasks.problem.extract_answer`) from ``#### x`` (one token) or, for a formula without words, from
    ``\\boxed{x}`` can equal it. A word beside other text cannot: ``93 apples``, ``Answer: 93`` and ``the result is
    93`` read from ``#### ...`` as ``93``, ``Answer:`` and ``the``."""
    want = normalize_answer(truth)
    if extract_answer(f"#### {truth}") == want:
        return True
    return not _WORD_RE.search(truth) and extract_answer(f"\\boxed{{{truth}}}") == want


class NotAnAnswer(BadInput):
    """A row's ground truth is free text without a final answer in it."""


def load_problems(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """Read problems from JSONL (one object per line) or verl-style parquet.

    A row needs a prompt (``prompt`` as text or chat messages, or ``question`` / ``problem``) and a ground truth
    (``reward_model.ground_truth``, ``ground_truth``, ``answer`` — GSM8K's ``#### x`` is extracted — or
    ``solution`` with ``\\boxed{x}``). Errors name the file, the row (1-based) and the field; ground truths that are
    prose rather than an answer (``"the result is 93"``: no response's final answer could ever equal it) are refused
    with every such row named."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"dataset {str(path)!r} does not exist: pass a local .jsonl or .parquet file")
    if limit is not None and limit < 1:
        raise BadInput(f"limit must be >= 1 (or None for every row), got {limit}")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise BadInput(f"{path} is not a readable parquet file ({str(e).splitlines()[0][:160]}); the file is "
                           "truncated or not parquet: write it again (e.g. pandas.DataFrame.to_parquet)") from None
        numbered = [(i + 1, r) for i, r in enumerate(rows)]
    elif path.suffix in (".jsonl", ".json"):
        numbered = []
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise BadInput(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the file as UTF-8") from None
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadInput(f"{path}, row {i}: not valid JSON ({e.msg}); each line must be one object")
            if not isinstance(row, dict):
                raise BadInput(f"{path}, row {i}: expected a JSON object, got {type(row).__name__}")
            numbered.append((i, row))
    else:
        raise BadInput(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl or .parquet")
    if not numbered:
        raise BadInput(f"dataset {path} is empty: it needs at least one row with a prompt and a ground truth")
    out, prose = [], []
    for i, row in numbered[:limit]:
        try:
            out.append(_row_to_problem(row, f"{path}, row {i}"))
        except NotAnAnswer as e:
            prose.append((i, str(e)))
    if prose:
        rows = ", ".join(str(i) for i, _ in prose[:8]) + (", ..." if len(prose) > 8 else "")
        raise BadInput(f"{path}: the ground truth of {len(prose)} of {len(numbered[:limit])} rows is text, not a "
                       f"final answer (rows {rows}; row {prose[0][0]}: {prose[0][1]}): rewards compare a "
                       "response's final answer ('#### 93', '\\boxed{93}') with it, so they would all be 0; give "
                       "the answer alone ('93'), GSM8K's '<solution> #### 93' or '\\boxed{93}'")
    for p in out:
        p.meta["dataset"] = str(path)               # named by errors about the data (e.g. check_coverage)
    return out


TASKS = ("chain", "words")


def task_config(task):
    """The generated task's config: a name (``"chain"``: the tiny reasoner's chain task; ``"words"``: GSM8K-style
    word problems for real models, :mod:`tltlib.tasks.wordproblems`) or a config (returned as it is)."""
    if task is None or task == "chain":
        return ChainTaskConfig()
    if task == "words":
        return WordTaskConfig()
    if isinstance(task, (ChainTaskConfig, WordTaskConfig)):
        return task
    raise BadInput(f"unknown task {task!r}; choose one of {TASKS} (or pass a dataset file)")


def generate_task(task, count: int, seed: int) -> list[Problem]:
    """``count`` problems of a generated task (a name or config, see :func:`task_config`), seeded ``seed``."""
    cfg = task_config(task)
    if isinstance(cfg, WordTaskConfig):
        return generate_word_problems(cfg, count, seed)
    return generate_problems(cfg, count, seed)


def problems_for(dataset: str | os.PathLike, count: int, seed: int, skip: int = 0, task=None) -> list[Problem]:
    """``count`` problems: from ``dataset`` (rows ``skip .. skip + count``, wrapping around a short file) or, when
    ``dataset`` is empty, freshly generated problems of ``task`` (a name or config: chain by default) seeded
    ``seed``."""
    if not dataset:
        return generate_task(task, count, seed)
    rows = load_problems(resolve(dataset))
    return [rows[(skip + i) % len(rows)] for i in range(count)]


def split_problems(dataset: str | os.PathLike, train: int, held_out: int, seed: int,
                   task=None, train_task=None) -> tuple[list[Problem], list[Problem]]:
    """(``train`` training problems, ``held_out`` held-out problems) that never share a prompt.

    From ``dataset``: the held-out problems are the rows after the training rows, and the training problems cycle
    (as epochs) over at most ``rows - held_out`` rows; a file with no more than ``held_out`` rows is refused. Without
    a dataset: generated problems with seeds ``seed`` and ``seed + 10_000``, of ``train_task`` (default: the chain
    task) and ``task`` (the held-out ones); each a name or config, see :func:`task_config`.
    """
    if not dataset:
        return problems_for("", train, seed, task=train_task), problems_for("", held_out, seed + 10_000, task=task)
    rows = load_problems(resolve(dataset))
    n_train = min(train, len(rows) - held_out)
    if n_train < 1:
        raise BadInput(f"{dataset}: {len(rows)} rows cannot hold {held_out} held-out problems and at least one "
                       f"training problem apart; lower eval_problems (at most {len(rows) - 1}) or use a larger "
                       "dataset")
    return ([rows[i % n_train] for i in range(train)], rows[n_train:n_train + held_out])


def _verl_row(p: Problem, index: int) -> dict:
    prompt = list(p.prompt) if not isinstance(p.prompt, str) else [{"role": "user", "content": p.prompt}]
    return {"data_source": p.meta.get("source", "tltlib"), "prompt": prompt, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"index": index, "steps": p.meta.get("steps", -1)}}


def save_problems(problems: list[Problem], path: str | os.PathLike) -> Path:
    """Write problems as JSONL (``prompt`` / ``answer`` / ``meta``) or verl-style parquet, atomically."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".parquet"):
        raise BadInput(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl or .parquet")
    with atomic_file(path) as tmp:
        if path.suffix == ".jsonl":
            with open(tmp, "w", encoding="utf-8") as fh:
                for p in problems:
                    prompt = p.prompt if isinstance(p.prompt, str) else list(p.prompt)
                    meta = {k: v for k, v in p.meta.items() if k != "dataset"}
                    fh.write(json.dumps({"prompt": prompt, "answer": p.answer, **meta}) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.Table.from_pylist([_verl_row(p, i) for i, p in enumerate(problems)]), tmp)
    return path


def read_responses(path, vocab_size: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of every row of a responses file; a malformed row, or an id outside
    ``vocab_size`` (a file sampled from another model), is refused with its row number. A last line cut short (a
    sampling run killed mid-write) is refused too: delete that line. ``.jsonl.gz``: read through gzip."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"responses file {str(path)!r} does not exist; write one with "
                       "python -m tltlib sample-responses")
    out = []
    if path.suffix == ".gz":
        import gzip
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
    else:
        text = path.read_text(encoding="utf-8")
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            p, r = row["prompt_ids"], row["response_ids"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise BadInput(f"{path}, row {i}: expected {{\"prompt_ids\": [...], \"response_ids\": [...]}} "
                           "(a line cut short by a killed run: delete it)") from None
        ids = p + r
        if not p or not r or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise BadInput(f"{path}, row {i}: prompt_ids and response_ids must be non-empty lists of token ids")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise BadInput(f"{path}, row {i}: token id {max(ids)} is outside this model's vocabulary of "
                           f"{vocab_size}: the file was sampled from another model")
        out.append((p, r))
    if not out:
        raise BadInput(f"{path} holds no responses")
    return out
