"""This machine, as the measurements that depend on it name it: the CPU's model and instruction-set flags, its cores,
the threads torch uses, the torch version, the last-level cache; what a results file records of it
(:func:`machine_info`) and how a call is timed on it (:func:`call_times`).

A kernel choice or a cost measured on one CPU is a fact about that CPU (an AMD EPYC and an Intel Xeon of the same
cloud "kind" disagree by 2-3x on which projection kernel is fastest for one row): what depends on the machine is
cached under a :class:`Machine` and refused, with what differs named, on another one
(:mod:`tltlib.kernels.table`, the ragged-attention build of :mod:`tltlib.kernels.ragged_attention`).

Departures: none (bookkeeping only).
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .errors import BadInput

_CPUINFO = Path("/proc/cpuinfo")


def env_switch(name: str, off: str, on: str) -> bool:
    """The on/off environment switch ``name`` (unset: on): ``0``/``off``/``false``/``no`` off, ``1``/``on``/``true``/
    ``yes`` on; any other value is one :class:`tltlib.errors.BadInput` saying what each setting does (``off``,
    ``on``), never a value silently read as one of them."""
    value = os.environ.get(name, "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    raise BadInput(f"{name}={os.environ[name]!r}: set it to 0 ({off}) or 1 ({on})")


def _cpuinfo_field(*names: str) -> str:
    """The first ``/proc/cpuinfo`` line starting with one of ``names``, its value; "" where there is none."""
    try:
        for line in _CPUINFO.read_text().splitlines():
            if line.startswith(names):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_name() -> str:
    """The CPU's model name (``AMD EPYC``, ``Intel Xeon Processor (Icelake)``), or the platform's processor string."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> str:
    """The CPU's instruction-set flags as ``/proc/cpuinfo`` lists them ("" where it cannot be read)."""
    return _cpuinfo_field("flags", "Features")


def vector_isa(flags: str | None = None) -> str:
    """The widest vector instructions in ``flags`` (default: this CPU's, :func:`cpu_flags`): ``avx512-amx`` (AVX-512
    with AMX tiles), ``avx512``, ``avx2``, ``sve``, ``neon``, or ``""``. A results file names it beside the CPU: VMs
    of one model name (``AMD EPYC``) differ in it, and with it in their kernels' speed."""
    have = set((cpu_flags() if flags is None else flags).split())
    for isa, needs in (("avx512-amx", {"avx512f", "amx_tile"}), ("avx512", {"avx512f"}), ("avx2", {"avx2"}),
                       ("sve", {"sve"}), ("neon", {"asimd"})):
        if needs <= have:
            return isa
    return ""


def described(info: dict) -> str:
    """A :func:`machine_info` record in words: the GPU, or the CPU with its widest vector instructions where
    recorded, and the threads (``AMD EPYC (AVX2, 2 threads)``)."""
    isa = f"{info['isa'].upper()}, " if info.get("isa") and not info.get("gpu") else ""
    return f"{info.get('gpu') or info['cpu']} ({isa}{info['threads']} threads)"


def llc_bytes(default: int = 32 << 20) -> int:
    """Bytes of the largest CPU cache (the last level), from sysfs; ``default`` where sysfs does not say."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else default


@dataclass(frozen=True)
class Machine:
    """What a CPU measurement depends on. Two machines with equal fields run the same kernels at the same speeds,
    up to noise; any field that differs makes a measurement of the one stale on the other."""

    cpu: str
    """The CPU's model name."""
    flags: str
    """A digest of its instruction-set flags (VMs of one model name can expose different instruction sets)."""
    cores: int
    """Logical CPUs the OS reports."""
    threads: int
    """Threads torch's CPU kernels use (``torch.get_num_threads()``)."""
    torch: str
    """The torch version (its kernels and their thresholds change between releases)."""

    def differences(self, here: "Machine") -> list[str]:
        """What differs between this (recorded) machine and ``here``, in words (empty when nothing does)."""
        words = {"cpu": "CPU", "flags": "CPU flags", "cores": "cores", "threads": "threads", "torch": "torch"}
        return [f"{words[f.name]} {getattr(self, f.name)!r} there, {getattr(here, f.name)!r} here"
                for f in fields(self) if getattr(self, f.name) != getattr(here, f.name)]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Machine":
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise BadInput(f"a machine record needs exactly the keys {sorted(names)}, got {d!r}")
        return cls(**d)

    @property
    def slug(self) -> str:
        """A file-name-safe name of the CPU and threads (``amd-epyc-2t``, ``intel-xeon-processor-2t``), for
        per-machine cache files; trademark marks such as ``(R)`` dropped."""
        cpu = re.sub(r"\((r|tm)\)", " ", self.cpu.lower())
        name = "".join(c if c.isalnum() else "-" for c in cpu).strip("-")
        while "--" in name:
            name = name.replace("--", "-")
        return f"{name[:40] or 'cpu'}-{self.threads}t"


def this_machine() -> Machine:
    """The :class:`Machine` this process runs on, with torch's current thread count."""
    import torch
    return Machine(cpu=cpu_name(), flags=hashlib.sha1(cpu_flags().encode()).hexdigest()[:12],
                   cores=os.cpu_count() or 1, threads=torch.get_num_threads(), torch=torch.__version__)


def available_bytes(device) -> int:
    """Memory free for this process on ``device``: the GPU's free memory and what PyTorch's allocator holds unused
    (this process reuses it), or the machine's MemAvailable (Linux), else the physical memory."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + int(unused)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_sync(device):
    """What a timer of work on ``device`` (a ``torch.device``, a name such as ``"cuda:0"``, or None) calls before
    each read of a host clock: ``torch.cuda.synchronize(device)`` on a GPU, whose calls return once the work is
    queued (without it a timer times the launches, not the work); nothing elsewhere (a CPU call returns when done)."""
    if device is None:
        return _no_sync
    import torch
    dev = torch.device(device) if isinstance(device, str) else device
    if getattr(dev, "type", None) != "cuda":
        return _no_sync
    return lambda: torch.cuda.synchronize(dev)


def _no_sync() -> None:
    pass


def call_times(fn, repeats: int, device) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after one warm-up call, CUDA synchronised around each call
    when ``device`` (a ``torch.device`` or its name) is a GPU (:func:`device_sync`)."""
    sync = device_sync(device)
    fn()
    out = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


def machine_info(device: str = "cpu") -> dict:
    """The machine a measurement ran on, for a results file: CPU model, threads, versions, the GPU on ``cuda``."""
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "device": device, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "cpu": cpu_name(), "isa": vector_isa()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info
