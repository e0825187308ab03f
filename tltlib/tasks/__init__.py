"""Problems, datasets and tokenizers: the chain task the tiny reasoner was trained on, GSM8K-style word problems for
real models, dataset files (JSONL, verl-style parquet) and what a model reads (prompts through the chat template,
with a check that the tokenizer covers the data) and scores."""
from .chain import ChainTaskConfig, generate_problems
from .datasets import (
                       TASKS,
                       generate_task,
                       load_problems,
                       problems_for,
                       read_responses,
                       save_problems,
                       split_problems,
                       task_config,
)
from .problem import Problem, extract_answer, normalize_answer, reward
from .prompts import encode_prompts, prompt_text, score_responses
from .tokenizer import load_tokenizer
from .wordproblems import WordTaskConfig, generate_word_problems

__all__ = ["TASKS", "ChainTaskConfig", "Problem", "WordTaskConfig", "encode_prompts", "extract_answer",
           "generate_problems", "generate_task", "generate_word_problems", "load_problems", "load_tokenizer",
           "normalize_answer", "problems_for", "prompt_text", "read_responses", "reward", "save_problems",
           "score_responses", "split_problems", "task_config"]
