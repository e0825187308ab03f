"""AdamW for a module that computes in bfloat16 or float16: float32 master weights and optimizer states, the standard
mixed-precision recipe (Micikevicius et al., "Mixed Precision Training", ICLR 2018; Megatron-LM's and DeepSpeed's
bf16 optimizers; PyTorch's ``torch.amp`` for the loss scale).

A bf16 weight has 8 significant bits: an AdamW update of size ``lr`` moves a weight ``w`` only when it exceeds half
of ``w``'s rounding step, ``|w| * 2**-8``. At the learning rates of RL fine-tuning (1e-6) that is almost never: five
AdamW steps directly on SmolLM2's bf16 weights changed 1.9% of them at lr 1e-6 (issue 54), so the rewards and the
drafter's drift of such a run mean nothing, while its step times look fine. Here the optimizer steps float32 copies
(the *master weights*) and writes their rounding into the module after each step: small updates accumulate in the
masters until they move the module's weights, as they would in float32.

:class:`MixedPrecisionAdamW` is used the way a trainer uses ``torch.optim.AdamW``, with two more calls:

1. ``backward(loss)`` (the loss scaled first for float16) after each micro-batch's loss, then ``accumulate()``,
   which adds the module's low-precision gradients into the masters' float32 gradients and frees them (an
   accumulation over many micro-batches does not round in bf16 either);
2. ``clip_grad_norm(max_norm)`` over the masters' gradients (unscaled), then ``step()``: AdamW on the masters, their
   rounding copied into the module; it returns the share of the module's weights that the step changed.

A float32 module is its own master: no copy is made and every call is plain AdamW (bit for bit).

Departures: on CUDA the step is torch's fused AdamW (one kernel, no per-step temporaries the size of the
moments); elsewhere its default (foreach). Float16 uses PyTorch's dynamic loss scale (``torch.amp.GradScaler``): a
step whose gradients overflow is skipped, and the scale halves (as ``torch.amp`` does); bfloat16 has float32's range
and needs none.
"""
from __future__ import annotations

import math

import torch

from ..errors import BadInput

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Parameter dtypes that get float32 master weights."""


class MixedPrecisionAdamW:
    """AdamW over float32 master copies of a module's bf16/fp16 parameters (module docstring).

    Args:
        params: the module's parameters (``module.parameters()``; those that require no gradient are left out),
            which the trainer's forwards use.
        lr, betas, weight_decay, eps: ``torch.optim.AdamW``'s, applied to the masters.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.01,
                 eps: float = 1e-8):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise BadInput("MixedPrecisionAdamW got no parameters that require a gradient: nothing to train")
        self.master = [p.detach().float() if p.dtype in LOW_PRECISION else p for p in self.params]
        fused = all(m.is_cuda for m in self.master) or None      # one kernel per step on CUDA, no foreach temporaries
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps,
                                           fused=fused)
        fp16 = any(p.dtype == torch.float16 for p in self.params)
        self.scaler = torch.amp.GradScaler(self.params[0].device.type) if fp16 else None

    @property
    def mixed(self) -> bool:
        """Whether the masters are copies (a bf16/fp16 module); False: a float32 module is its own master."""
        return any(m is not p for p, m in zip(self.params, self.master))

    @property
    def param_groups(self) -> list[dict]:
        """AdamW's parameter groups (set ``lr`` here)."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """AdamW's per-master state (``exp_avg``, ``exp_avg_sq``, ``step``), keyed by the tensors in :attr:`master`."""
        return self.optimizer.state

    def zero_grad(self) -> None:
        """Drop the module's and the masters' gradients."""
        for p, m in zip(self.params, self.master):
            p.grad = None
            m.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled first under float16 (:attr:`scaler`)."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def accumulate(self) -> None:
        """Add the module's low-precision gradients into the masters' float32 gradients and free them; call after
        each backward (a float32 module accumulates in place: nothing to do)."""
        for p, m in zip(self.params, self.master):
            if m is p or p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the masters' gradients (accumulated first, unscaled under float16) to ``max_norm`` (``inf``: no clip)
        and return their norm before clipping (``inf``/``nan`` when they overflowed)."""
        self.accumulate()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        return float(torch.nn.utils.clip_grad_norm_(self.master, max_norm))

    def step(self) -> float:
        """One AdamW step on the masters and their rounding copied into the module. Returns the share of the
        module's weights that changed (nan for a float32 module, which is its own master; 0 for a float16 step
        skipped because its gradients overflowed)."""
        self.accumulate()
        if self.scaler is None:
            self.optimizer.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale:            # the step was skipped: its gradients overflowed
                return 0.0
        return self.push()

    @property
    def overflow_skips(self) -> bool:
        """Whether a non-finite gradient norm is a float16 overflow, which :meth:`step` skips (else: divergence)."""
        return self.scaler is not None

    @torch.no_grad()
    def push(self) -> float:
        """Copy the masters' rounding into the module's weights; the share of its elements that changed (nan when the
        module is float32)."""
        if not self.mixed:
            return math.nan
        changed = total = 0
        for p, m in zip(self.params, self.master):
            if m is p:
                continue
            new = m.to(p.dtype)
            changed += int((new != p).sum())
            total += p.numel()
            p.copy_(new)
        return changed / max(total, 1)

    @torch.no_grad()
    def pull(self) -> None:
        """Take the masters from the module's weights (after the module was loaded or replaced from outside)."""
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.copy_(p)

    def state_dict(self) -> dict:
        """AdamW's state dict, plus the float32 masters (``master_weights``) when they are copies."""
        sd = self.optimizer.state_dict()
        if self.mixed:
            sd["master_weights"] = [m.detach().clone() for m in self.master]
        if self.scaler is not None:
            sd["loss_scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict`'s output; the masters come from it, or (a state saved without them, e.g. of a
        float32 run) from the module's weights, which must be loaded first."""
        sd = dict(sd)
        masters, scaler = sd.pop("master_weights", None), sd.pop("loss_scaler", None)
        if masters is not None and len(masters) != len(self.master):
            raise BadInput(f"the optimizer state holds {len(masters)} master weights for {len(self.master)} "
                           "parameters: it belongs to another model")
        self.optimizer.load_state_dict(sd)
        if masters is None or not self.mixed:
            self.pull()
        else:
            with torch.no_grad():
                for m, saved in zip(self.master, masters):
                    m.copy_(saved)
            self.push()
        if scaler is not None and self.scaler is not None:
            self.scaler.load_state_dict(scaler)

    def master_weights(self) -> list[torch.Tensor]:
        """The float32 weights the optimizer steps, one per parameter (the parameters themselves for float32)."""
        return self.master
