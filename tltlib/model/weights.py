"""A model's weights in and out of transformers' layout: the one strict loader (config.json + safetensors) and the
saver.

:func:`load_model` refuses, with the file and the fix named, everything that would otherwise run with numbers other
than the model folder's: a config field the decoder does not implement (checked in :meth:`ModelConfig.from_hf`), a
tensor the config does not use (e.g. ``num_hidden_layers`` smaller than the layers in the weights), a tensor it needs
that is missing, a shape that does not fit, a non-finite value, an unreadable file. :func:`check_tensors` is the
check itself, shared with the drafter loader.

Departures from transformers' loader:
1. transformers warns about unused or missing weights and initialises the missing ones randomly; here both are
   errors. The only tensors passed over are rotary ``inv_freq`` buffers of old models (recomputed from the
   config) and a stored ``lm_head.weight`` that equals the embedding when the config ties them.
2. Every tensor is checked for NaN/inf at load time (one pass over the weights), so a corrupt file fails at
   once instead of as ``probability tensor contains inf/nan`` in the middle of a rollout.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from ..errors import BadInput, NotFound
from ..fileio import atomic_folder, read_json
from ..kernels.huge_pages import place_parameters
from .decoder import ModelConfig, Transformer, rope_inv_freq

IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def hf_layer_names(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Our fused parameter name (within layer ``i``) -> the transformers names it concatenates, in order."""
    p = f"model.layers.{i}."
    names = {"input_norm.weight": [p + "input_layernorm.weight"],
             "attn.qkv.weight": [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
             "attn.o.weight": [p + "self_attn.o_proj.weight"],
             "post_norm.weight": [p + "post_attention_layernorm.weight"],
             "mlp.gate_up.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
             "mlp.down.weight": [p + "mlp.down_proj.weight"]}
    if cfg.qkv_bias:
        names["attn.qkv.bias"] = [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
    if cfg.o_bias:
        names["attn.o.bias"] = [p + "self_attn.o_proj.bias"]
    if cfg.mlp_bias:
        names["mlp.gate_up.bias"] = [p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]
        names["mlp.down.bias"] = [p + "mlp.down_proj.bias"]
    return names


def hf_name_map(cfg: ModelConfig) -> dict[str, list[str]]:
    """Every parameter of :class:`Transformer` -> the transformers tensor names it is made of."""
    m = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        m.update({f"layers.{i}.{k}": v for k, v in hf_layer_names(cfg, i).items()})
    return m


def split_fused(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[torch.Tensor]:
    """Split one of our fused tensors (``...qkv...`` or ``...gate_up...``) into transformers' parts, in order."""
    if ".qkv." in name:
        sizes = [cfg.num_heads * cfg.dim_head] + [cfg.num_kv_heads * cfg.dim_head] * 2
    elif ".gate_up." in name:
        sizes = [cfg.intermediate_size] * 2
    else:
        return [t]
    return list(t.split(sizes, dim=0))


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Split fused tensors back into transformers' names (contiguous copies, safe to save)."""
    sd = model.state_dict()
    return {n: part.contiguous() for ours, theirs in hf_name_map(model.config).items()
            for n, part in zip(theirs, split_fused(model.config, ours, sd[ours]))}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """transformers tensor name -> shape, for every tensor a model folder of ``cfg`` must hold."""
    with torch.device("meta"):
        model = Transformer(cfg, init_std=0.0)
    return {k: tuple(v.shape) for k, v in to_hf_state_dict(model).items()}


# ------------------------------------------------------------------------------------------------- checks
def _layers_of(names) -> list[int]:
    return sorted({int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))})


def _sample(names, k: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:k]) + (f" (+{len(names) - k} more)" if len(names) > k else "")


def check_tensors(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], source: str,
                  num_layers: int | None = None, config_name: str = "config.json") -> None:
    """Refuse any mismatch between the tensors a model folder holds and those its config implies.

    Args:
        found: name -> shape of every tensor in the files (``IGNORED`` names already removed).
        expected: name -> shape the config implies.
        source: the model folder's path, for the messages.
        num_layers: the config's layer count, to say "the weights hold N layers" when layers are extra or missing.
    """
    unused, missing = found.keys() - expected.keys(), expected.keys() - found.keys()
    hint = f" Is {config_name} from the same model as the weights?"
    layer_hint = ""
    if num_layers is not None and (unused or missing):
        held = _layers_of(found)
        if held and held[-1] + 1 != num_layers:
            layer_hint = (f" The weights hold {held[-1] + 1} layers but config.json's num_hidden_layers is "
                          f"{num_layers}: use the config.json that came with these weights.")
    if unused:
        raise BadInput(f"{source}: the weights hold {len(unused)} tensors the config does not use "
                       f"({_sample(unused)}); they would be silently dropped.{layer_hint or hint}")
    if missing:
        raise BadInput(f"{source}: the weights lack {len(missing)} tensors the config needs "
                       f"({_sample(missing)}).{layer_hint or hint}")
    bad = [f"{n} is {list(found[n])}, expected {list(s)}" for n, s in sorted(expected.items()) if found[n] != s]
    if bad:
        shown = "; ".join(bad[:3])
        raise BadInput(f"{source}: {len(bad)} tensors do not have the shape the config implies ({shown}); "
                       f"is {config_name} from the same model as the weights?")


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Refuse NaN or inf in any floating-point tensor, naming the first bad one and the share of bad values."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = (~torch.isfinite(t)).sum().item()
            raise BadInput(f"{source}: tensor {name} holds {bad} non-finite values (NaN or inf) out of "
                           f"{t.numel()}; the file is corrupt or the training diverged: use an earlier or "
                           "re-downloaded model")


def check_floating(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights that are not floating point (int8 / int4 packed: a quantised model), which a cast would
    turn into a model of raw integers."""
    ints = sorted((n, t.dtype) for n, t in tensors.items() if not t.is_floating_point())
    if ints:
        name, dtype = ints[0]
        raise BadInput(f"{source}: {len(ints)} weight tensors are not floating point ({name} is "
                       f"{str(dtype).removeprefix('torch.')}): the model is quantised; tltlib loads float32, "
                       "bfloat16 or float16 weights: dequantise it with transformers and save it again")


# ------------------------------------------------------------------------------------------------- reading
def fingerprint(module: torch.nn.Module) -> str:
    """A short digest of ``module``'s state (every tensor's name, shape, dtype and bytes, in name order): equal for
    the same weights on any device, different when one element differs. What the alarms compare after a weight sync
    or a drafter merge, and what a tuner prior file records of its drafter."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read ``config.json`` of a local model folder (clear errors for a missing, broken or unsupported one)."""
    path = Path(path)
    if not path.is_dir():
        raise NotFound(f"model folder {str(path)!r} does not exist: pass a local folder holding "
                       "config.json and *.safetensors (as written by transformers' save_pretrained)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise NotFound(f"{cfg_file} is missing: the model folder needs transformers' config.json")
    d = read_json(cfg_file, "fix or replace it with the model's original config.json")
    if not isinstance(d, dict):
        raise BadInput(f"{cfg_file}: expected a JSON object, got {type(d).__name__}")
    return ModelConfig.from_hf(d, source=str(cfg_file))


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file() and (path / "model.safetensors").is_file():
        raise BadInput(f"{path} holds both model.safetensors and model.safetensors.index.json (shards), which "
                       "may be different weights; remove the stale one")
    if index.is_file():
        d = read_json(index, "re-save the model with save_pretrained")
        if not isinstance(d, dict) or not isinstance(d.get("weight_map"), dict):
            raise BadInput(f"{index}: no 'weight_map' object; re-save the model with save_pretrained")
        files = [path / f for f in sorted(set(d["weight_map"].values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise NotFound(f"{index} lists shards that are not in the folder: {absent}; copy them too")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise NotFound(f"{path} has no model.safetensors or model.safetensors.index.json: re-save the "
                   "model with save_pretrained(..., safe_serialization=True)")


def read_safetensors(files: list[Path], device="cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the given safetensors files; an unreadable file is named in the error."""
    from safetensors import SafetensorError, safe_open
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as fh:
                for n in fh.keys():
                    if n in out:
                        raise BadInput(f"{f}: tensor {n} is also in another shard; the model folder is inconsistent")
                    out[n] = fh.get_tensor(n)
        except (SafetensorError, OSError) as e:
            raise BadInput(f"{f} is not a readable safetensors file ({e}); the file is truncated or corrupt: "
                           "copy or save it again") from None
    return out


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's safetensors (one file or shards), by transformers name, unchecked (the
    strict loader is :func:`load_model`)."""
    return read_safetensors(_weight_files(Path(path)))


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> Transformer:
    """Load a LlamaForCausalLM / Qwen2ForCausalLM model (single or sharded safetensors) from a local folder.

    Strict: every tensor in the files must be one the config implies, with its shape, and finite (see the module
    docstring); otherwise a ValueError names the file, the tensors and the likely fix."""
    path = Path(path)
    cfg = load_config(path)
    tensors = read_safetensors(_weight_files(path), device)
    for n in [n for n in tensors if IGNORED.search(n)]:
        del tensors[n]
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        head, emb = tensors.pop("lm_head.weight"), tensors.get("model.embed_tokens.weight")
        if emb is None or head.shape != emb.shape or not torch.equal(head, emb):
            raise BadInput(f"{path}: config.json ties the LM head to the embedding (tie_word_embeddings: true) "
                           "but the weights hold a different lm_head.weight; set tie_word_embeddings to false "
                           "if the head is trained separately")
    check_tensors({n: tuple(t.shape) for n, t in tensors.items()}, expected_shapes(cfg), str(path), cfg.num_layers)
    check_floating(tensors, str(path))
    check_finite(tensors, str(path))
    tensors = {n: t.to(dtype) for n, t in tensors.items()}
    check_finite(tensors, f"{path} (after conversion to {str(dtype).removeprefix('torch.')}: values beyond that "
                          "type's range; load it in a wider dtype)")
    with torch.device("meta"):
        model = Transformer(cfg, init_std=0.0)
    state = {ours: torch.cat([tensors[n] for n in theirs], dim=0) for ours, theirs in hf_name_map(cfg).items()}
    model.load_state_dict(state, assign=True, strict=True)
    place_parameters(model)                            # on a CPU, its big weights on huge pages (kernels.huge_pages)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def save_model(model: Transformer, path: str | os.PathLike, extra_files: dict[str, str] | None = None) -> Path:
    """Save in transformers' layout (config.json + model.safetensors), atomically: a temporary folder is renamed.

    ``extra_files`` maps file names to text written beside (e.g. a model card). Other files already in the folder
    (a tokenizer next to re-saved weights) are kept; stale weight shards are not."""
    from safetensors.torch import save_file
    with atomic_folder(path, keep_existing=lambda f: not f.name.startswith("model")) as tmp:
        cfg = model.config.to_hf()
        cfg["torch_dtype"] = str(model.embed.weight.dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tensors = {k: v.detach().cpu() for k, v in to_hf_state_dict(model).items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return Path(path)


# ------------------------------------------------------------------------------------------- the one loader
DTYPES = ("float32", "bfloat16", "float16")


def pick_device(name: str = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when available, else ``"cpu"``; other names are checked and returned."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"device {name!r} but CUDA is not available here; use 'cpu' or 'auto'")
    if name != "cpu" and not name.startswith("cuda"):
        raise BadInput(f"unknown device {name!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return name


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` (or a torch dtype) -> the torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise BadInput(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return getattr(torch, name)
