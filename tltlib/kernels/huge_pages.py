"""A model's CPU weights on huge pages: memory in 2 MiB pages where Linux offers them (transparent huge pages,
``/sys/kernel/mm/transparent_hugepage/enabled`` ``always`` or ``madvise``), so a decode step that streams every weight
from memory misses the TLB once per 2 MiB instead of once per 4 KiB.

Measured (AMD EPYC, AVX2, 2 threads, in one process, 4 KiB and 2 MiB copies of the same data alternated): the
``stream`` kernel on SmolLM2's 113 MB LM head 1.07-1.09x faster from huge pages, a sum over a 1 GiB buffer
1.08-1.12x. So a one-row step reads its weights faster, and so does the memory floor it is set against: the
benches measure the machine's read bandwidth on huge pages where the weights lie on them (``bench/_common.py``).

PyTorch does the same for every CPU allocation of 2 MiB or more when ``THP_MEM_ALLOC_ENABLE=1`` is set before it
starts (its CPU allocator aligns them to 2 MiB and advises ``MADV_HUGEPAGE``); a library cannot set that for its
user (importing tltlib changes no global state, and torch has allocated by then), so the loader places the weights
itself, the same way: :func:`empty` maps 2 MiB more than asked (anonymous, private), advises ``MADV_HUGEPAGE`` on the
2 MiB-aligned stretch the tensor takes, and never touches the rest, so the tensor's last partial 2 MiB stays on
4 KiB pages and nothing beyond the tensor's own bytes becomes memory.

``TLTLIB_HUGE_PAGES=0`` keeps every tensor on the allocator's pages. Elsewhere (no transparent huge pages, not Linux,
tensors under 2 MiB) :func:`empty` is ``torch.empty``. The values are the same either way: only where they lie.
"""
from __future__ import annotations

import bisect
import math
import mmap
from pathlib import Path

import torch

from ..machine import env_switch

ENV = "TLTLIB_HUGE_PAGES"
HUGE_PAGE = 2 << 20
"""Bytes of a huge page (x86-64's and arm64's transparent huge page with 4 KiB base pages); tensors smaller than
this are left to the allocator, as PyTorch's ``THP_MEM_ALLOC_ENABLE`` leaves them."""
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP) -> str:
    """This kernel's transparent-huge-page mode, the bracketed word of ``path`` (``always``, ``madvise``,
    ``never``), or ``unavailable`` where there is no such file (not Linux, a kernel without THP)."""
    try:
        text = path.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def enabled(path: Path = THP) -> bool:
    """Whether :func:`empty` places tensors of 2 MiB or more on huge pages here: ``TLTLIB_HUGE_PAGES`` allows it,
    the kernel offers them on advice (``always`` or ``madvise``) and Python can give that advice."""
    return (env_switch(ENV, "every tensor on the allocator's pages", "a model's CPU weights on huge pages")
            and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode(path) in ("always", "madvise"))


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, on: bool | None = None) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, on huge pages where ``on`` (default:
    :func:`enabled`) and it takes at least :data:`HUGE_PAGE` bytes; else ``torch.empty``'s. Its memory is freed
    with the last tensor that views it."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not (enabled() if on is None else on):
        return torch.empty(tuple(shape), dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE   # a multiple of 4 KiB
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:                                    # advice refused (a kernel without THP for this mapping):
        pass                                           # the same memory on 4 KiB pages
    # a storage of the tensor's bytes only (torch.save writes a whole storage), holding the mapping for its life
    return torch.frombuffer(region, dtype=dtype, count=numel, offset=start).view(tuple(shape))


def placed(t: torch.Tensor, on: bool | None = None) -> torch.Tensor:
    """``t``'s values in a tensor from :func:`empty` (``t`` itself where that would be ``torch.empty``'s: a CUDA
    tensor, one under 2 MiB, huge pages off or unavailable; and a non-contiguous one, whose strides a copy would
    change)."""
    if (t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() < HUGE_PAGE
            or not (enabled() if on is None else on)):
        return t
    return empty(t.shape, t.dtype, on=True).copy_(t)


def mappings(smaps: Path = Path("/proc/self/smaps")) -> list[dict]:
    """This process's memory mappings from ``smaps``, by address: ``{"start", "end", "advised": MADV_HUGEPAGE
    given (the ``hg`` flag), "huge_bytes": bytes of it on huge pages now}``; empty where it cannot be read."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        head = line.split(None, 1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            first, _, end = head.partition("-")
            try:
                found.append({"start": int(first, 16), "end": int(end, 16), "advised": False, "huge_bytes": 0})
            except ValueError:
                continue
        elif found and head == "AnonHugePages:":
            found[-1]["huge_bytes"] = int(line.split()[1]) * 1024
        elif found and head == "VmFlags:":
            found[-1]["advised"] = "hg" in line.split()[1:]
    return sorted(found, key=lambda m: m["start"])


def mapping(t: torch.Tensor, maps: list[dict] | None = None, starts: list[int] | None = None) -> dict | None:
    """The mapping of :func:`mappings` (default: read now; ``starts``, their start addresses, where the caller
    looks up many tensors) holding ``t``'s first byte; None where none does."""
    maps = mappings() if maps is None else maps
    starts = [m["start"] for m in maps] if starts is None else starts
    i = bisect.bisect_right(starts, t.data_ptr()) - 1
    return maps[i] if i >= 0 and t.data_ptr() < maps[i]["end"] else None


def huge_bytes(tensors) -> tuple[int, int]:
    """Of CPU ``tensors``, the bytes on huge pages now (each mapping counted once, at most its tensors' bytes) and
    their bytes in all: what the benches report beside a step on huge-page weights. ``(0, total)`` where smaps
    cannot be read."""
    maps = mappings()
    starts = [m["start"] for m in maps]
    mine: dict[int, list[int]] = {}
    total = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        total += size
        m = mapping(t, maps, starts)
        if m is not None:
            mine.setdefault(m["start"], [m["huge_bytes"], 0])[1] += size
    return sum(min(h, size) for h, size in mine.values()), total


def place_parameters(module: torch.nn.Module, on: bool | None = None) -> int:
    """Every CPU parameter of ``module`` of 2 MiB or more moved onto huge pages (:func:`placed`; the parameter
    objects stay, their ``data`` is the copy), where ``on`` (default :func:`enabled`); returns the bytes moved. The
    loaders call it: the model's values are unchanged, only where they lie."""
    moved, on = 0, enabled() if on is None else on
    for p in module.parameters():
        data = p.data                                  # a new tensor object on every access
        q = placed(data, on)
        if q is not data:
            p.data = q
            moved += q.numel() * q.element_size()
    return moved
