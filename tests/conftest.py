"""Shared fixtures: small random transformers checkpoints of both supported families, and the GPU marker (its tests
skipped without CUDA; in them a failed CUDA graph capture is an error, :data:`CAPTURE_FALLBACK_FAILS`).

Kernel choices: the tests run with PyTorch's default kernels (``TLTLIB_KERNELS=0``, inherited by the workers,
notebooks and commands they start), not with the machine's kernel table, which is chosen by timing and so would make
a test's numerics depend on the machine's load at the moment it was measured (and would write to the user's cache).
Every candidate kernel is tested against the defaults explicitly (test_kernel_choice: each one and a model decoding
the same tokens under tables forcing each; test_packed_weights, test_ragged_attention: theirs forced).
``TLTLIB_KERNELS=1 pytest`` runs them with the machine's table instead.

Threads: one torch thread per test process (``OMP_NUM_THREADS=1`` unless set, inherited by what a test starts).
On the 2-core development VM (Intel Xeon) tests/test_specdecode.py took 30 s on one thread against 41 s on two, and
beside two busy loops (bench/busy.py) 45 s against 112 s: OpenMP's threads wait on each other at every barrier when
another process shares their cores. The kernels' multi-threaded loops are tested on two threads explicitly
(test_ragged_attention).

Workers: ``python -m tltlib test`` runs the suite in pytest-xdist workers, one per core
(:func:`tltlib.cli.commands.test_workers`), handing out one test at a time, those marked ``long`` first: a test must
not depend on another having run before it in its process."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")       # before torch starts its thread pool
os.environ.setdefault("TLTLIB_KERNELS", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))   # also where torch was imported before this file

CAPTURE_FALLBACK_FAILS = "error:CUDA graph capture:RuntimeWarning"
"""The gpu tier's warning filter: a CUDA graph capture that fails (``GraphPool._build`` warns and runs the key
eagerly) is an error in any gpu test, so a fallback can never pass as a graphed run."""


def long_first(items: list) -> None:
    """Put the tests marked ``long`` first, in place, each group in its order (a stable sort: every xdist worker
    collects the same order, as xdist requires), so that a parallel run (``python -m tltlib test``) hands them out
    first and the short ones fill the workers' ends instead of one worker ending alone on a long test."""
    items.sort(key=lambda item: "long" not in item.keywords)


def pytest_collection_modifyitems(config, items):
    long_first(items)
    gpu = [item for item in items if "gpu" in item.keywords]
    for item in gpu:
        item.add_marker(pytest.mark.filterwarnings(CAPTURE_FALLBACK_FAILS))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in gpu:
        item.add_marker(skip)


HF_VARIANTS = {
    # Llama with every optional feature on: biases, llama3 rope scaling, untied head
    "llama-full": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                                 rope_theta=500000.0,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
}


def make_hf_model(family: str, vocab: int = 97, **kw):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    cls = LlamaConfig if family == "llama" else Qwen2Config
    cfg = cls(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():                       # HF inits biases to 0 and norms to 1: randomise everything
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="session", params=sorted(HF_VARIANTS))
def hf_checkpoint(request, tmp_path_factory):
    """(transformers model, folder it is saved in) for each supported family/variant."""
    family, kw = HF_VARIANTS[request.param]
    model = make_hf_model(family, **kw)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness-of-fit p-value of observed ``counts`` against ``probs`` (same length).

    Bins whose expected count is below ``min_expected`` are pooled into one; a count in a zero-probability bin
    returns 0.0 (impossible outcome observed)."""
    import numpy as np
    from scipy.stats import chisquare
    counts = np.asarray(counts, dtype=np.float64)
    p = np.asarray(probs, dtype=np.float64)
    if counts[p <= 0].sum() > 0:
        return 0.0
    p = p / p.sum()
    exp = p * counts.sum()
    big = exp >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def first_tokens_pvalue(target, prompt, res, temperature, top_k, top_p, n: int = 3) -> float:
    """Chi-square p-value of the first ``n`` sampled tokens of every response in ``res`` that has at least ``n``
    (no EOS among its first n - 1) against their exact joint distribution under ``target`` (enumerated)."""
    import itertools

    import numpy as np
    import torch

    from tltlib.model.sampling import probs_from_logits
    v, eos = target.config.vocab_size, target.config.eos_token_ids[0]
    seqs = list(itertools.product(range(v), repeat=n))
    with torch.no_grad():
        logits = target(torch.tensor([prompt + list(s) for s in seqs]))
    probs = probs_from_logits(logits[:, len(prompt) - 1: len(prompt) + n - 1], temperature, top_k, top_p).double()
    exact = probs.gather(-1, torch.tensor(seqs)[..., None])[..., 0].prod(-1).numpy()
    full = res.lengths.numpy() == n
    counts = np.bincount(np.ravel_multi_index(res.tokens[:, :n].numpy()[full].T, [v] * n), minlength=v ** n)
    eos_paths = np.array([eos in s[: n - 1] for s in seqs])
    return chi2_pvalue(counts[~eos_paths], exact[~eos_paths])
