"""Which kernel computes a projection or a cached attention on this machine: candidates by name (``dispatch``), the
machine's kernel table of measured choices (``table``), the search that fills it (``search``) and the CPU decode
attention kernel in C++ (``ragged_attention``). The model calls :func:`linear` and :func:`cached_attention` and never
branches on the device."""
from .dispatch import WeightPacks, cached_attention, linear, pack_weights, packed_weights
from .search import ensure as ensure_kernels

__all__ = ["WeightPacks", "cached_attention", "ensure_kernels", "linear", "pack_weights", "packed_weights"]
