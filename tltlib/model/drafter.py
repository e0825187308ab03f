"""EAGLE-1-style one-layer drafter that shares the target's frozen embedding and LM head.

At position t the drafter reads the target's final hidden state f_t and the embedding of the next token x_{t+1}:

    h = fc([embed(x_{t+1}); f_t])          (2H -> H, no bias)
    h = DecoderLayer(h)                      (the target's block type, without the attention's input RMSNorm)
    f̂_{t+1} = h,  q(x_{t+2}) = softmax(lm_head(h) / T)

It predicts the target's next hidden state and, through the target's head, the token after next. Drafting feeds its
own f̂ back in. The embedding and head are the *target's* tensors, read at call time and never copied into the
drafter's parameters, optimizer or files, so a policy update is seen at once and a drafter sync never overwrites
the target (a bug class of the reference implementation).

Paper: TLT §4 (adaptive drafter: one trainable decoder layer, frozen embedding and head from the target).
Reference: ``verl/workers/drafter/model/*_eagle.py`` (fc over [embed; hidden], identity input norm, no final norm).

Departures:
1. ``fc`` has no bias, in training and inference alike (the reference trains without and serves with one), which is
   also vLLM's EAGLE layout (:func:`export_vllm_eagle`).
2. Files hold only the drafter's own tensors plus a config naming the target's shape; loading checks the target
   matches (hidden size, vocabulary, architecture) instead of failing later with a shape error.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BadInput, NotFound, Refused
from ..fileio import atomic_folder, read_json, resolve
from ..kernels.dispatch import linear
from ..kernels.huge_pages import place_parameters
from ..kv.dense import KVCache
from ..kv.paged import KVConfig, make_cache
from . import native
from .decoder import DecoderLayer, ModelConfig, Transformer, rope_cos_sin, rope_inv_freq
from .weights import check_finite, check_tensors, hf_layer_names, read_safetensors, split_fused

CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "drafter.safetensors"


@dataclass(frozen=True)
class DrafterConfig:
    """Shape of a drafter: the target's block with one layer (built by :meth:`from_target`)."""

    target: ModelConfig
    """The target's config, one layer kept (attention/MLP shapes, rope, norm eps, vocabulary)."""
    draft_vocab_size: int = 0
    """Tokens the drafter may propose; 0: the whole vocabulary. A reduced draft vocabulary (as EAGLE-3's) applies
    the LM head to those rows only (set by :meth:`Drafter.set_draft_vocab`, chosen by :func:`frequent_tokens`):
    with a large vocabulary the head is most of a draft step's cost (SmolLM2: 28 M of the 32 M multiply-adds per
    drafted token). Lossless either way: the proposal q is a distribution over these tokens and verification uses
    it as it is; a token outside them is never proposed, but the target still samples it."""

    def __post_init__(self):
        if not 0 <= self.draft_vocab_size <= self.target.vocab_size:
            raise BadInput(f"draft_vocab_size={self.draft_vocab_size} must lie in 0..{self.target.vocab_size} "
                           "(the target's vocabulary; 0: all of it)")

    @classmethod
    def from_target(cls, cfg: ModelConfig) -> "DrafterConfig":
        return cls(replace(cfg, num_layers=1))

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    def to_dict(self) -> dict:
        d = asdict(self.target)
        d["rope_scaling"] = [list(kv) for kv in self.target.rope_scaling]
        d["eos_token_ids"] = list(self.target.eos_token_ids)
        return {"format": "tltlib-eagle-drafter", "version": 1, "target": d,
                "draft_vocab_size": self.draft_vocab_size}

    @classmethod
    def from_dict(cls, d: dict, source: str = CONFIG_FILE) -> "DrafterConfig":
        if d.get("format") != "tltlib-eagle-drafter":
            raise BadInput(f"{source}: not a tltlib drafter config (format {d.get('format')!r})")
        t = dict(d["target"])
        t["rope_scaling"] = tuple(tuple(kv) for kv in t.get("rope_scaling", ()))
        t["eos_token_ids"] = tuple(t.get("eos_token_ids", ()))
        return cls(ModelConfig(**t), int(d.get("draft_vocab_size", 0)))


class Drafter(nn.Module):
    """The drafter. Create with ``Drafter(DrafterConfig.from_target(target.config))`` and :meth:`attach` a target
    (or :func:`load_drafter`, which attaches)."""

    def __init__(self, cfg: DrafterConfig, init_std: float = 0.02):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(cfg.target, input_norm=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.target), persistent=False)
        self.register_buffer("draft_ids", None)             # the draft vocabulary [n], or None (all tokens)
        if cfg.draft_vocab_size:
            self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab_size))
        self._target: list[Transformer] = []              # a list, so the target is not registered as a submodule
        self.version = 0          # the weights the rollout drafts with, replaced by trained ones: metrics.METRICS
        self.source: str | None = None    # the folder it was loaded from (its card: the alarms' accept floor)
        if init_std:
            for name, p in self.named_parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=init_std)

    def _apply(self, fn, recurse=True):
        """Casts keep the rotary frequencies float32 (see :meth:`tltlib.model.decoder.Transformer._apply`)."""
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config.target).to(self.inv_freq.device)
        return self

    # ----------------------------------------------------------------------------------------------- target
    def attach(self, target: Transformer) -> "Drafter":
        """Share ``target``'s embedding and LM head (checked to fit); returns self."""
        check_compatible(self.config, target.config)
        self._target[:] = [target]
        return self

    def is_attached_to(self, target: Transformer) -> bool:
        """Whether ``target`` is the model this drafter reads its embedding and head from."""
        return bool(self._target) and self._target[0] is target

    @property
    def target(self) -> Transformer:
        if not self._target:
            raise Refused("the drafter has no target attached: call drafter.attach(target) first")
        return self._target[0]

    def logits(self, hidden: torch.Tensor, full: bool = False) -> torch.Tensor:
        """Proposal logits ``[..., V]`` through the target's LM head (frozen: no gradient reaches the target).

        With a draft vocabulary only its rows of the head are read (the current head, so a policy that RL changes
        is always seen) and every other token gets -inf; ``full=True`` applies the whole head (training targets
        and losses)."""
        w = self.target.head_weight.detach()
        if full or self.draft_ids is None:
            return linear(hidden, w)
        sub = self.draft_logits(hidden)
        out = sub.new_full((*sub.shape[:-1], w.shape[0]), float("-inf"))
        return out.index_copy_(out.dim() - 1, self.draft_ids, sub)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., Vd]`` over the draft vocabulary only (column j is token ``draft_ids[j]``; the whole head,
        ``Vd = V``, without one): what the drafter can propose, at ``Vd / V`` of the head's cost."""
        w = self.target.head_weight.detach()
        return linear(hidden, w if self.draft_ids is None else w.index_select(0, self.draft_ids))

    def set_draft_vocab(self, ids: torch.Tensor | None) -> "Drafter":
        """Restrict proposals to the token ids ``ids [n]`` (unique, within the vocabulary; None: all tokens);
        returns self. Saved with the drafter."""
        vocab = self.config.target.vocab_size
        if ids is None:
            self.draft_ids = None
            self.config = replace(self.config, draft_vocab_size=0)
            return self
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise BadInput(f"draft vocabulary: ids must be non-empty and lie in 0..{vocab - 1} (the target's "
                           "vocabulary); pick them with tltlib.model.drafter.frequent_tokens")
        ids = ids.sort().values
        if bool((ids[1:] == ids[:-1]).any()):
            raise BadInput("draft vocabulary: ids repeat; pass each token once (torch.unique)")
        self.config = replace(self.config, draft_vocab_size=int(ids.numel()))
        self.register_buffer("draft_ids", ids.to(self.fc.weight.device))
        return self

    def _input(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        emb = F.embedding(tokens, self.target.embed.weight.detach())
        return linear(torch.cat([emb, hidden.to(emb.dtype)], dim=-1), self.fc.weight)

    # ---------------------------------------------------------------------------------------------- forwards
    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training forward over whole sequences of pairs.

        Args:
            hidden: ``[B, T, H]`` target hidden states f_0 .. f_{T-1}.
            tokens: ``[B, T]`` the tokens after them, x_1 .. x_T.

        Returns:
            (predicted hidden ``[B, T, H]`` = f̂_1 .. f̂_T, logits ``[B, T, V]`` for x_2 .. x_{T+1}).
        """
        out = self.features(hidden, tokens)
        return out, self.logits(out)

    def features(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without the LM head: predicted hidden states ``[B, T, H]`` (training computes the head
        in chunks, so no ``[B, T, V]`` logits are held for a large vocabulary)."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.fc.weight.dtype)
        return self.layer(self._input(hidden, tokens), cos, sin)

    def forward_cached(self, hidden: torch.Tensor, tokens: torch.Tensor, cache: KVCache,
                       positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                       logits_at: torch.Tensor | None = None, offset: int = 0, rope=None):
        """Inference forward over the drafter's one-layer cache (same contract as Transformer.forward_cached).

        Pair j of a row sits at cache entry j and rotary position j, exactly as in :meth:`forward`. ``rope``:
        precomputed (cos, sin) for these positions (saves recomputing them at every chain-draft step)."""
        b, t = tokens.shape
        if rope is not None:
            cos, sin = rope
        else:
            if positions is None:
                positions = cache.lengths[:b, None] + (offset + torch.arange(t, device=tokens.device))
            cos, sin = rope_cos_sin(self.inv_freq, positions, self.fc.weight.dtype)
        write = cache.prepare(t, tree_mask, offset)
        x = self._input(hidden, tokens)
        out = native.run_layers(self, (self.layer,), None, self.config.target, x, cos, sin, cache, write)
        if out is None:                                # not in one C++ call here (model.native): the Python layer
            out = self.layer(x, cos, sin, cache, 0, write)
        if logits_at is not None:
            out_at = out[torch.arange(b, device=out.device), logits_at]
            return self.logits(out_at), out_at
        return self.logits(out), out

    def new_cache(self, rows: int, max_len: int, kv: KVConfig | None = None, budget_bytes: int | None = None):
        """The drafter's one-layer KV cache (:func:`tltlib.kv.paged.make_cache`: paged by default)."""
        w = self.fc.weight
        return make_cache(self.config.target, rows, max_len, kv, w.dtype, w.device, 1, budget_bytes)


def frequent_tokens(tokens: torch.Tensor, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The ``size`` most frequent ids of ``tokens`` (any shape) plus every id in ``always`` (e.g. EOS), sorted
    ``[<= size + len(always)]``; ids never seen are not added. The draft vocabulary of
    :meth:`Drafter.set_draft_vocab`."""
    if size <= 0:
        raise BadInput(f"draft vocabulary size must be positive (got {size})")
    counts = torch.bincount(tokens.flatten().cpu().long(), minlength=vocab_size)[:vocab_size]
    top = torch.topk(counts, min(size, vocab_size)).indices
    top = top[counts[top] > 0]
    return torch.unique(torch.cat([top, torch.as_tensor(list(always), dtype=torch.long)]))


def check_compatible(cfg: DrafterConfig, target: ModelConfig, source: str = "drafter") -> None:
    """Clear errors when a drafter does not fit a target."""
    d = cfg.target
    for field, what in (("architecture", "architecture"), ("hidden_size", "hidden size"),
                        ("vocab_size", "vocabulary size"), ("num_heads", "attention heads"),
                        ("num_kv_heads", "key/value heads"), ("intermediate_size", "MLP width")):
        if getattr(d, field) != getattr(target, field):
            raise BadInput(f"{source} does not match the target: its {what} is {getattr(d, field)!r} but the "
                           f"target's is {getattr(target, field)!r}; train a drafter for this target "
                           "(python -m tltlib train-drafter) or load the target it was trained for")


# ------------------------------------------------------------------------------------------------ files
def check_separate(drafter: nn.Module, target: nn.Module) -> None:
    """Refuse a drafter whose parameters share storage with ``target``'s (they would be synced and trained as the
    drafter's)."""
    ptrs = {t.data_ptr() for t in target.parameters()}
    shared = [n for n, p in drafter.named_parameters() if p.data_ptr() in ptrs]
    if shared:
        raise BadInput(f"drafter parameters {shared} share storage with the target: they would be synced and "
                       "trained as the drafter's; keep the target's tensors out of the drafter's parameters")


def save_drafter(drafter: Drafter, path: str | os.PathLike, extra_files: dict[str, str] | None = None) -> Path:
    """Write ``drafter_config.json`` + ``drafter.safetensors`` (own tensors only) into a folder, atomically.

    ``extra_files`` maps file names to text written in the same atomic step (a card, a training log): the folder
    is replaced as a whole, so new weights never sit beside an old card."""
    from safetensors.torch import save_file
    with atomic_folder(path) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(drafter.config.to_dict(), indent=1) + "\n")
        save_file({k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()},
                  str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(path)


def is_drafter_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a drafter written by :func:`save_drafter`."""
    return (Path(path) / CONFIG_FILE).is_file()


def _onto(drafter: Drafter, target: Transformer) -> Drafter:
    """A loaded drafter on ``target``'s device and dtype, its big CPU weights on huge pages (kernels.huge_pages),
    attached to ``target``."""
    w = target.embed.weight
    drafter = drafter.to(device=w.device, dtype=w.dtype)
    place_parameters(drafter)
    return drafter.attach(target)


def load_drafter(path: str | os.PathLike, target: Transformer) -> Drafter:
    """Load a drafter saved by :func:`save_drafter` and attach it to ``target`` (its device and dtype); a relative
    ``path`` that does not exist as given is read under the project root (as :func:`tltlib.model.load` does).

    Refused with the file named: a missing or corrupt file, a drafter of another target, a tensor missing, extra or
    of the wrong shape, a non-finite value."""
    path = resolve(path)
    cfg_file, w_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file() or not w_file.is_file():
        raise NotFound(f"no drafter in {str(path)!r}: expected {CONFIG_FILE} and {WEIGHTS_FILE} (train one "
                       "with python -m tltlib train-drafter, or pass the folder it was saved to)")
    d = read_json(cfg_file, "re-save or retrain the drafter")
    try:
        cfg = DrafterConfig.from_dict(d, str(cfg_file))
    except (KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{cfg_file} is corrupt ({type(e).__name__}: {e}); re-save or retrain the drafter") from None
    check_compatible(cfg, target.config, source=f"drafter {path}")
    state = read_safetensors([w_file])
    drafter = Drafter(cfg, init_std=0.0)
    check_tensors({k: tuple(v.shape) for k, v in state.items()},
                  {k: tuple(v.shape) for k, v in drafter.state_dict().items()}, str(w_file), config_name=CONFIG_FILE)
    check_finite(state, str(w_file))
    drafter.load_state_dict(state, strict=True)
    if drafter.draft_ids is not None:
        try:
            drafter.set_draft_vocab(drafter.draft_ids)
        except ValueError as e:
            raise BadInput(f"{w_file}: {e}; re-save or retrain the drafter") from None
    drafter.source = str(path)
    return _onto(drafter, target)


# -------------------------------------------------------------------------------------------- vLLM export
def vllm_eagle_tensors(drafter: Drafter, include_embedding: bool = True) -> dict[str, torch.Tensor]:
    """The drafter in vLLM's EAGLE layout: ``fc.weight [H, 2H]``, ``layers.0.*`` in transformers' names without
    ``input_layernorm``, and (by default) ``embed_tokens.weight`` copied from the target."""
    cfg = drafter.config.target
    ours = dict(drafter.layer.state_dict())
    out = {"fc.weight": drafter.fc.weight.detach()}
    for name, parts in hf_layer_names(cfg, 0).items():
        if not name.startswith("input_norm"):
            out.update({p.removeprefix("model."): x.detach() for p, x in zip(parts, split_fused(cfg, name,
                                                                                                ours[name]))})
    if include_embedding:
        out["embed_tokens.weight"] = drafter.target.embed.weight.detach()
    return {k: v.cpu().contiguous() for k, v in out.items()}


def export_vllm_eagle(drafter: Drafter, path: str | os.PathLike, include_embedding: bool = True) -> Path:
    """Write a vLLM-loadable EAGLE model folder (``architectures: ["EagleLlamaForCausalLM"]``, one layer), atomically.

    vLLM builds the drafter as a Llama layer whatever the target, and its Llama layer reads ``attention_bias`` as
    "q/k/v *and* o_proj have biases" unless ``qkv_bias`` says otherwise; its EAGLE loader reports no missing tensor,
    so a bias it builds but the file lacks stays uninitialised (a Qwen2 drafter then proposes garbage). The config
    therefore names each bias explicitly (``qkv_bias``; ``attention_bias`` = the o_proj bias; ``mlp_bias``) and the
    file holds exactly the tensors those flags make vLLM build. A draft vocabulary is not exported (vLLM's EAGLE-1
    drafter proposes from the whole vocabulary: still lossless, drafting just costs more)."""
    from safetensors.torch import save_file
    cfg = drafter.config.target
    hf = cfg.to_hf()
    hf.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1, model_type="llama",
              attention_bias=cfg.o_bias, qkv_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    with atomic_folder(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        save_file(vllm_eagle_tensors(drafter, include_embedding), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
    return Path(path)


def load_vllm_eagle(path: str | os.PathLike, target: Transformer) -> Drafter:
    """Read a model folder written by :func:`export_vllm_eagle` back into a :class:`Drafter`."""
    path = Path(path)
    hf = read_json(path / "config.json", "export the drafter again")
    if hf.get("architectures") != ["EagleLlamaForCausalLM"]:
        raise BadInput(f"{path}/config.json is not an EAGLE model folder (architectures {hf.get('architectures')})")
    tensors = read_safetensors([path / "model.safetensors"])
    check_finite(tensors, str(path / "model.safetensors"))
    drafter = Drafter(DrafterConfig.from_target(target.config), init_std=0.0)
    check_compatible(drafter.config, target.config)
    cfg = drafter.config.target
    state = {"fc.weight": tensors["fc.weight"]}
    for name, parts in hf_layer_names(cfg, 0).items():
        if not name.startswith("input_norm"):
            state[f"layer.{name}"] = torch.cat([tensors[p.removeprefix("model.")] for p in parts], dim=0)
    drafter.load_state_dict(state, strict=True)
    return _onto(drafter, target)
