"""The vLLM column of ``bench decode`` / ``bench speculative`` (bench/_vllm.py, bench/vllm_worker.py).

Default tier: the pipe between the bench and the worker, with a stand-in ``vllm`` package (a few lines that echo the
prompt) put on the worker's path: requests and replies, a worker whose prints and child processes write to stdout
(they must not reach the protocol stream), the bench's column emptying vLLM's prefix cache before every call (and a
plain request not), an error inside vLLM and a worker that dies come back as one clear error,
``--vllm compiled`` without vLLM stops the bench. The ``vllm`` tier runs the real vLLM (``.venv-vllm``): greedy
tokens equal tltlib's.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import _vllm  # noqa: E402

FAKE = '''
import os, subprocess, sys
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, seed, stop_token_ids):
        self.max_tokens, self.temperature = max_tokens, temperature
class _Out:
    def __init__(self, ids): self.token_ids = ids
class _Req:
    def __init__(self, ids): self.outputs = [_Out(ids)]
class _Metric:
    def __init__(self, name, value): self.name, self.value = name, value
class LLM:
    def __init__(self, model, **kw):
        import importlib.util                                # as transformers probes for the HF kernels package:
        spec = importlib.util.find_spec("kernels")           # the bench's kernels.py must not be found (it imports
        if spec is not None and "bench" in (spec.origin or ""):   # tltlib, absent from vLLM's venv)
            raise ImportError(f"the worker's path finds {spec.origin} as the module kernels")
        if model == "broken":
            raise ValueError("no such model: broken")
        print("vLLM banner on stdout")                       # must not reach the protocol stream
        subprocess.run([sys.executable, "-c", "print('engine process says hi')"])
        self.kw, self.calls = kw, 0
    def generate(self, prompts, params, use_tqdm=False):
        if params.temperature < 0:
            raise RuntimeError("bad temperature")
        if params.temperature == 99:
            os._exit(3)
        self.calls += 1
        return [_Req([(t + 1) % 50 for t in p["prompt_token_ids"]][: params.max_tokens]) for p in prompts]
    def reset_prefix_cache(self):
        print("prefix cache reset")                         # to the worker's log
        return True
    def get_metrics(self):
        return [_Metric("vllm:spec_decode_num_drafts", 10 * self.calls),
                _Metric("vllm:spec_decode_num_accepted_tokens", 25 * self.calls)]
'''
INPUTS = "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE))
    (pkg / "inputs.py").write_text(INPUTS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    return Path(sys.executable)


def test_the_worker_answers_requests_over_the_pipe_and_keeps_vllms_prints_out_of_it(fake_vllm):
    with _vllm.VLLMPeer(fake_vllm, "model-dir", drafter="eagle-dir", k=4, startup_timeout=60) as peer:
        assert peer.startup_s >= 0
        a = peer.generate([[1, 2, 3], [49]], max_tokens=2)
        b = peer.generate([[7, 8]], max_tokens=5, stop=[0])
        log = peer.log_path.read_text()
    assert a["tokens"] == [[2, 3], [0]] and b["tokens"] == [[8, 9]]
    assert a["seconds"] >= 0 and (a["drafts"], a["accepted"], b["drafts"]) == (10, 25, 20)
    assert "vLLM banner on stdout" in log and "engine process says hi" in log


def test_the_column_empties_vllms_prefix_cache_before_every_call_and_a_plain_request_does_not(fake_vllm):
    """A bench times the same prompts round after round; vLLM's prefix cache would serve them from the round before,
    which no rollout sees: the column asks for an empty cache each time (outside vLLM's timed call)."""
    with _vllm.VLLMPeer(fake_vllm, "model-dir", startup_timeout=60) as peer:
        peer.generate([[1, 2]], max_tokens=1)
        plain = peer.log_path.read_text().count("prefix cache reset")
        column = _vllm.VLLMColumn(peer, new_tokens=2)
        assert column([[1, 2], [3]]) == [[2, 3], [4]] and column([[5]]) == [[6]]
        log = peer.log_path.read_text()
    assert plain == 0 and log.count("prefix cache reset") == 2
    assert "prefix cache emptied before each call" in _vllm.setup_note(fake_vllm, eager=False)


@pytest.mark.parametrize("model, temperature, expected", [
    ("broken", 0.0, "vLLM failed during start: ValueError: no such model: broken"),
    ("m", -1.0, "vLLM failed during generate: RuntimeError: bad temperature"),
    ("m", 99.0, "vLLM worker exited with status 3 during generate"),
])
def test_a_failure_in_vllm_comes_back_as_one_clear_error(fake_vllm, model, temperature, expected):
    with pytest.raises(RuntimeError, match=expected):
        with _vllm.VLLMPeer(fake_vllm, model, startup_timeout=60) as peer:
            peer.generate([[1]], max_tokens=1, temperature=temperature)


def test_vllm_peer_off_or_absent_gives_no_column_and_a_named_mode_without_vllm_stops(monkeypatch, tmp_path):
    monkeypatch.setenv("TLTLIB_VLLM_PYTHON", str(tmp_path / "none" / "python"))
    monkeypatch.setattr(_vllm.importlib.util, "find_spec", lambda name: None)
    assert _vllm.vllm_peer("off", "m", "float32", 4) == (None, "")
    assert _vllm.vllm_peer("auto", "m", "float32", 4) == (None, "")
    with pytest.raises(SystemExit, match="--vllm: compiled asks for vLLM .* python -m tltlib setup-vllm"):
        _vllm.vllm_peer("compiled", "m", "float32", 4)


@pytest.mark.vllm
@pytest.mark.skipif(_vllm.vllm_python() is None, reason="no .venv-vllm: python -m tltlib setup-vllm")
@pytest.mark.long
def test_the_real_vllm_column_decodes_what_tltlib_decodes(monkeypatch):
    # vLLM's engine in the column's worker process, not spawned from it (the same engine and tokens; the bench itself
    # runs vLLM's default): on an AMD EPYC, 2 cores, an LLM of the tiny reasoner started in 3.3 s against 24.8 s
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tltlib.model.loading import load
    from tltlib.model.sampling import SamplingConfig
    from tltlib.rollout.engine import RolloutConfig, RolloutEngine
    target, _, _ = load(ROOT / "data" / "tiny-reasoner", device="cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (int(n),), generator=g).tolist() for n in (5, 9, 3)]
    ours = RolloutEngine(target, RolloutConfig(SamplingConfig(temperature=0, max_new_tokens=24), ignore_eos=True))
    res = ours.generate(prompts)
    col, note = _vllm.vllm_peer("eager", ROOT / "data" / "tiny-reasoner", "float32", 24, max_model_len=256)
    try:
        assert col(prompts) == [res.response_ids(i) for i in range(len(prompts))]
    finally:
        col.close()
    assert "vLLM-cpu eager" in note
