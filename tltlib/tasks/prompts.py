"""What a model reads and what its responses score: a problem's prompt text (chat messages through the tokenizer's
chat template), prompts encoded with a check that the tokenizer covers the data (no silent ``<unk>``), and the
rewards of a rollout's responses.

Departures: none.
"""
from __future__ import annotations

from ..errors import BadInput
from .problem import Problem, reward


def prompt_text(problem: Problem, tokenizer=None) -> str:
    """The text fed to the model: plain prompts as they are; chat messages through the tokenizer's chat template
    (with the generation prompt). Without a tokenizer (for display) the message contents joined by newlines; a
    tokenizer without a chat template is refused for chat messages (the model would see text laid out as it was
    never trained to read, with no sign of it)."""
    if isinstance(problem.prompt, str):
        return problem.prompt
    messages = [dict(m) for m in problem.prompt]
    if tokenizer is None:
        return "\n".join(m["content"] for m in messages)
    if not getattr(tokenizer, "chat_template", None):
        raise BadInput("the prompts are chat messages but this model's tokenizer has no chat template: give a "
                       "model whose tokenizer_config.json has a 'chat_template' (an instruct model), or plain-text "
                       "prompts (a dataset whose 'prompt' is a string; the word task with WordTaskConfig(chat="
                       "False))")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(problems: list[Problem], tokenizer, max_unknown: float = 0.0) -> list[list[int]]:
    """Token ids of each problem's prompt text (with the tokenizer's special tokens, e.g. BOS).

    Refuses data the tokenizer cannot represent (see :func:`check_coverage`): a prompt whose characters become
    ``<unk>`` would run with a garbled input, an answer the model cannot write would score 0 whatever it does."""
    texts = [prompt_text(p, tokenizer) for p in problems]
    ids = [tokenizer(t).input_ids for t in texts]
    check_coverage(texts, ids, [p.answer for p in problems], tokenizer,
                   next((p.meta["dataset"] for p in problems if "dataset" in p.meta), "the prompts"), max_unknown)
    return ids


def _unknown_chars(text: str, tokenizer) -> set[str]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return {text[a:b] for i, (a, b) in zip(enc.input_ids, enc.offset_mapping) if i == tokenizer.unk_token_id}


def check_coverage(texts: list[str], ids: list[list[int]], answers: list[str], tokenizer, source: str,
                   max_unknown: float = 0.0) -> None:
    """Raise when more than ``max_unknown`` of the prompt tokens are ``<unk>``, or an answer holds a character the
    tokenizer cannot produce; the message names ``source``, the share and the characters.

    Tokenizers without an unknown token (byte-level BPE, as in every real model) always pass."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return
    n_unk = sum(row.count(unk) for row in ids)
    total = sum(len(row) for row in ids)
    if n_unk > max_unknown * total:
        bad = [t for t, row in zip(texts, ids) if unk in row]
        chars = sorted(set().union(*(_unknown_chars(t, tokenizer) for t in bad)))
        raise BadInput(f"{source}: {n_unk} of {total} prompt tokens ({n_unk / total:.1%}, in {len(bad)} of "
                       f"{len(texts)} prompts) are unknown to the tokenizer, which has no token for "
                       f"{', '.join(map(repr, chars))}; the model cannot read this data. Use a model whose "
                       "tokenizer covers it (a real model), or this model's own task (DATASET empty)")
    cant = sorted(set().union(*(_unknown_chars(a, tokenizer) for a in set(answers))))
    if cant:
        raise BadInput(f"{source}: the ground-truth answers hold characters the tokenizer cannot produce "
                       f"({', '.join(map(repr, cant))}), so those answers could never be matched and their "
                       "reward would be 0 whatever the model does; use a model whose tokenizer covers them")


def score_responses(texts: list[str], problems: list[Problem], num_generations: int = 1) -> list[float]:
    """Reward of each response; response ``i`` answers ``problems[i // num_generations]``."""
    if len(texts) != len(problems) * num_generations:
        raise BadInput(f"{len(texts)} responses for {len(problems)} problems x group size {num_generations}")
    return [reward(t, problems[i // num_generations].answer) for i, t in enumerate(texts)]
