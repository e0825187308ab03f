"""The policy's weights between TRL's model (a transformers ``*ForCausalLM``) and the rollout's
:class:`tltlib.model.decoder.Transformer`: the architecture compared field by field, the weights compared tensor by
tensor (the first that differs named), and the sync that copies TRL's weights into the rollout's model in place.

TRL owns the policy: its optimizer updates ``trainer.model``; the rollout decodes with a copy in tltlib's layout
(q/k/v and gate/up fused), refreshed when TRL's ``global_step`` moved. The copy is in place, so the drafter (which
reads the target's embedding and head) and the packed CPU weights (re-made when a weight's version moves) follow.

Departures: none (plumbing).
"""
from __future__ import annotations

import torch

from ..errors import BadInput
from ..model.decoder import ModelConfig, Transformer
from ..model.weights import hf_name_map, split_fused


def unwrapped(model):
    """The transformers model inside accelerate's / DDP's wrappers (``.module``) as TRL's trainer holds it."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def is_peft(model) -> bool:
    """True for a PEFT-wrapped model (LoRA and other adapters)."""
    return hasattr(unwrapped(model), "peft_config")


def config_of(hf_model) -> ModelConfig:
    """tltlib's :class:`ModelConfig` of a transformers model (refused, naming the field, where the decoder does not
    implement it)."""
    return ModelConfig.from_hf(unwrapped(hf_model).config.to_dict(), source="TRL's model (trainer.model.config)")


TOKEN_FIELDS = ("bos_token_id", "eos_token_ids", "pad_token_id")
"""Not compared: TRL sets its model's pad id from the tokenizer, and the EOS ids TRL counts are the rollout's
(:mod:`.trl_rollout`)."""


def check_architecture(ours: ModelConfig, hf_model) -> None:
    """Refuse a TRL model whose architecture differs from the rollout's model, naming the first field (the token
    ids of :data:`TOKEN_FIELDS` aside)."""
    theirs = config_of(hf_model)
    for name in ours.__dataclass_fields__:
        if name in TOKEN_FIELDS:
            continue
        a, b = getattr(ours, name), getattr(theirs, name)
        if a != b:
            raise BadInput(f"TRL's model does not match the tltlib model of the rollout: its {name} is {b!r}, the "
                           f"tltlib model's is {a!r}; give the TRL trainer and tlt_rollout_func the same model "
                           "(or tlt_rollout_func(model=None) to decode with TRL's own weights)")


def hf_tensors(hf_model) -> dict[str, torch.Tensor]:
    """TRL's model's tensors by transformers name (views, no copy); a tied head included as the embedding."""
    return unwrapped(hf_model).state_dict()


def _parts(model: Transformer, hf: dict[str, torch.Tensor]):
    """(our parameter, its slice for one transformers tensor, that tensor's name, the tensor) in the map's order."""
    params = dict(model.named_parameters())
    for ours, names in hf_name_map(model.config).items():
        p = params[ours]
        pieces = split_fused(model.config, ours, p.detach())   # detach: shares the version counter
        for name, piece in zip(names, pieces):
            if name not in hf:
                raise BadInput(f"TRL's model has no tensor {name!r} (the tltlib model needs it for {ours!r}): "
                               "give both the same model")
            yield ours, piece, name, hf[name]


def first_difference(model: Transformer, hf: dict[str, torch.Tensor]) -> str | None:
    """The first transformers tensor (in the layers' order) whose shape or values differ from the rollout model's,
    with how (None when all are equal)."""
    for ours, piece, name, t in _parts(model, hf):
        if tuple(piece.shape) != tuple(t.shape):
            return f"{name} has shape {tuple(t.shape)} in TRL's model but {tuple(piece.shape)} in the tltlib model"
        if not torch.equal(piece, t.to(device=piece.device, dtype=piece.dtype)):
            diff = float((piece.double() - t.to(piece.device).double()).abs().max())
            return f"{name} differs (largest difference {diff:.3g})"
    return None


@torch.no_grad()
def copy_weights(model: Transformer, hf: dict[str, torch.Tensor]) -> None:
    """Copy TRL's weights into the rollout's model in place (each fused part into its slice)."""
    for ours, piece, name, t in _parts(model, hf):
        if tuple(piece.shape) != tuple(t.shape):
            raise BadInput(f"TRL's {name} has shape {tuple(t.shape)}, the tltlib model's {tuple(piece.shape)}")
        piece.copy_(t)
