"""A model's CPU weights on huge pages (tltlib.kernels.huge_pages): the kernel's mode read, tensors of 2 MiB or more
advised onto huge pages and 2 MiB-aligned, smaller ones and the switch left to the allocator, the values unchanged,
the memory alive as long as a view of it, the loaders placing the weights."""
from __future__ import annotations

import gc
import mmap

import pytest
import torch

from tltlib.errors import BadInput
from tltlib.kernels import huge_pages as hp

BIG = (1024, 640)                                      # 2.5 MiB of float32: one whole huge page and a 4 KiB tail


def _advice_visible() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and bool(hp.mappings())


needs_advice = pytest.mark.skipif(not _advice_visible(), reason="no MADV_HUGEPAGE or /proc/self/smaps here")


def test_the_mode_is_the_bracketed_word_and_unavailable_without_the_file(tmp_path):
    f = tmp_path / "enabled"
    for text, mode in [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never"), ("garbled", "unavailable")]:
        f.write_text(text)
        assert hp.thp_mode(f) == mode
    assert hp.thp_mode(tmp_path / "missing") == "unavailable"
    f.write_text("always madvise [never]")
    assert not hp.enabled(f)                                     # the kernel offers none: never placed


def test_the_switch_turns_placement_off_and_refuses_a_value_it_cannot_read(monkeypatch, tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never")
    monkeypatch.setenv(hp.ENV, "0")
    assert not hp.enabled(f)
    monkeypatch.setenv(hp.ENV, "maybe")
    with pytest.raises(BadInput, match="TLTLIB_HUGE_PAGES='maybe': set it to 0"):
        hp.enabled(f)
    monkeypatch.setenv(hp.ENV, "1")
    assert hp.enabled(f) == hasattr(mmap, "MADV_HUGEPAGE")


@needs_advice
def test_a_tensor_of_2_mib_or_more_is_advised_onto_huge_pages_aligned_and_a_smaller_one_is_not():
    t = hp.empty(BIG, torch.float32, on=True)
    m = hp.mapping(t)
    assert t.shape == BIG and t.is_contiguous() and t.data_ptr() % hp.HUGE_PAGE == 0
    assert m["advised"] and m["start"] == t.data_ptr()                 # the advice covers the tensor, from its start
    assert not hp.mapping(hp.empty((10, 10), torch.float32, on=True))["advised"]      # 400 bytes: the allocator's
    assert not hp.mapping(hp.empty(BIG, torch.float32, on=False))["advised"]          # switched off
    huge, total = hp.huge_bytes([t.fill_(1.0)])
    assert total == t.numel() * 4 and 0 <= huge <= total


@needs_advice
def test_placed_keeps_the_values_in_a_storage_of_its_bytes_that_lives_as_long_as_a_view_of_it():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(BIG, generator=g)
    t = hp.placed(src, on=True)
    assert t is not src and torch.equal(t, src) and hp.mapping(t)["advised"]
    assert t.untyped_storage().nbytes() == src.numel() * 4      # its own bytes only: torch.save writes no more
    view = t[3:5].clone(), t[3:5]
    del t
    gc.collect()
    assert torch.equal(view[1], view[0])                      # the mapping is held by the storage, not by `t`
    view[1].add_(1.0)                                         # and writable
    small, strided = torch.randn(4, generator=g), src.t()
    assert hp.placed(small, on=True) is small and hp.placed(src, on=False) is src
    assert hp.placed(strided, on=True) is strided                 # a copy would change its strides


@needs_advice
def test_place_parameters_moves_the_big_cpu_parameters_in_place_of_their_data():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(1024, 640), torch.nn.Linear(8, 8))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    params = list(module.parameters())
    moved = hp.place_parameters(module, on=True)
    assert moved == 1024 * 640 * 4                                     # the embedding only
    assert list(module.parameters()) == params                       # the same Parameter objects
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())
    assert hp.mapping(module[0].weight)["advised"] and not hp.mapping(module[1].weight)["advised"]
    assert hp.place_parameters(module, on=False) == 0


@needs_advice
def test_the_loader_puts_a_model_s_big_weights_on_huge_pages_with_their_values(tmp_path, monkeypatch):
    """A model saved and loaded on a CPU: its 2.5 MiB embedding (the tied LM head) advised onto huge pages where the
    kernel offers them, its small weights not; the values those saved; TLTLIB_HUGE_PAGES=0 keeps all on the
    allocator's pages."""
    from tltlib.model.decoder import ModelConfig, Transformer
    from tltlib.model.weights import load_model, save_model
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=1024, hidden_size=640, intermediate_size=64, num_layers=1, num_heads=10,
                      num_kv_heads=2, tie_word_embeddings=True)
    save_model(Transformer(cfg), tmp_path / "m")
    saved = load_model(tmp_path / "m")
    offered = hp.enabled()
    assert hp.mapping(saved.embed.weight)["advised"] == offered
    assert not hp.mapping(saved.layers[0].attn.o.weight)["advised"]               # 640 x 640 floats: 1.6 MiB
    monkeypatch.setenv(hp.ENV, "0")
    plain = load_model(tmp_path / "m")
    assert not hp.mapping(plain.embed.weight)["advised"]
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), plain.state_dict().values()))
