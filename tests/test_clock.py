"""Timers of device work: on a GPU every host-clock read of a phase boundary waits for the work queued so far
(``torch.cuda.synchronize``, faked here: no CUDA needed), never on a CPU."""
from __future__ import annotations

import pytest
import torch

from tltlib.machine import call_times, device_sync
from tltlib.rl.clock import StepClock


@pytest.fixture
def syncs(monkeypatch):
    """Every ``torch.cuda.synchronize`` call, by device (and the test's own markers between them)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_a_gpus_sync_waits_for_that_gpu(syncs, device):
    device_sync(device)()
    assert syncs == [torch.device(device)]


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_a_cpu_is_never_synchronised(syncs, device):
    clock = StepClock(device)
    with clock.phase("rollout"):
        pass
    clock.span("rollout", 0.0)
    call_times(lambda: None, 2, device)
    device_sync(device)()
    assert syncs == [] and set(clock.metrics()) == {"time/rollout_s", "time/step_s"}


def test_step_clock_synchronises_a_gpu_at_every_phase_boundary(syncs):
    gpu = torch.device("cuda")
    clock = StepClock(gpu)
    assert syncs == [gpu]                                   # the step starts after the work queued before it
    for name in ("rollout", "update"):
        with clock.phase(name):
            syncs.append(f"{name} work")
    assert syncs == [gpu, gpu, "rollout work", gpu, gpu, "update work", gpu]
    del syncs[:]
    clock.span("update sync", 0.0)                          # a span ending now: after the queued work
    clock.span("training", 0.0, 1.0)                        # a span of given times reads no clock
    assert syncs == [gpu] and [s[0] for s in clock.spans] == ["update sync", "training"]


def test_call_times_synchronise_a_gpu_named_by_string(syncs):
    call_times(lambda: syncs.append("call"), 1, "cuda:0")
    assert syncs == ["call", torch.device("cuda", 0), "call", torch.device("cuda", 0)]
