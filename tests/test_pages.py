"""The paged KV cache's bookkeeping (tltlib.kv.pages): pages taken as rows grow and given back, prompt pages shared by
a group's samples without a copy, copy-on-write where a sample writes into a shared page, and the errors."""
from __future__ import annotations

import pytest
import torch

from tltlib.kv.pages import BlockTables, PagePool, check_page_size, kv_bytes_per_token, pages_for


@pytest.mark.parametrize("bad", [0, -16, 12, 3, 1.5, True, "16"])
def test_a_page_size_is_a_positive_power_of_two(bad):
    with pytest.raises(ValueError, match=f"page_size must be a positive power of two \\(e.g. 16\\), got {bad!r}"):
        check_page_size(bad)
    assert [check_page_size(n) for n in (1, 2, 16, 256)] == [1, 2, 16, 256]


def test_pages_are_taken_lowest_first_and_given_back_once():
    pool = PagePool(4, page_size=8)
    assert pool.take(3) == [0, 1, 2] and pool.free == 1 and pool.used == 3
    assert pool.take(2) is None and pool.free == 1                   # too few: nothing taken
    pool.give_back([1])
    assert pool.take(2) == [1, 3]
    with pytest.raises(ValueError, match="page 1 is already free \\(given back twice\\)"):
        pool.give_back([1, 1])
    with pytest.raises(ValueError, match="page 0 is free: only a held page can be shared"):
        PagePool(2).share([0])


def test_a_budget_holds_whole_pages_and_refuses_less_than_one_prompt_naming_the_minimum():
    per_token = kv_bytes_per_token(num_layers=2, num_kv_heads=2, head_dim=8, elem_bytes=4)
    assert per_token == 2 * 2 * 2 * 8 * 4
    pool = PagePool.for_budget(10 * 16 * per_token + 5, per_token, page_size=16, min_tokens=40)
    assert pool.num_pages == 10 and pool.page_size == 16
    with pytest.raises(ValueError, match="a KV memory budget of 2,048 bytes holds 0 page\\(s\\) of 16 tokens "
                                         "\\(4,096 bytes each\\), but 40 tokens need 3: give it at least 12,288 bytes"):
        PagePool.for_budget(2048, per_token, page_size=16, min_tokens=40)


def test_a_row_takes_pages_as_it_grows_and_a_rollback_past_a_boundary_gives_them_back():
    t = BlockTables(PagePool(8, page_size=4))
    r = t.add_row()
    assert t.reserve(r, 5) and t.pages[r] == [0, 1]
    t.commit(r, 5)
    assert t.reserve(r, 8) and t.pages[r] == [0, 1]                  # still within the second page
    assert t.reserve(r, 9) and t.pages[r] == [0, 1, 2]
    t.commit(r, 9)
    t.truncate(r, 8)                                                   # one rejected token: back onto page 1
    assert t.pages[r] == [0, 1] and t.lengths[r] == 8 and t.pool.free == 6
    t.truncate(r, 4)
    assert t.pages[r] == [0] and t.pool.free == 7
    with pytest.raises(ValueError, match="row 0 holds 4 tokens, cannot truncate to 6"):
        t.truncate(r, 6)
    with pytest.raises(ValueError, match="row 0: 9 tokens committed but only 4 slots reserved"):
        t.commit(r, 9)
    t.release(r)
    assert t.pages[r] == [] and t.pool.free == 8


def test_the_samples_of_a_prompt_share_its_pages_and_copy_only_the_page_they_write_into():
    t = BlockTables(PagePool(16, page_size=4, run=1))                  # runs of one page: the lowest free first
    prompt = t.add_row()
    assert t.reserve(prompt, 10)
    t.commit(prompt, 10)                                               # pages 0, 1 full; page 2 holds 2 tokens
    samples = t.fork(prompt, 3)
    assert [t.pages[s] for s in samples] == [[0, 1, 2]] * 3 and t.pool.used == 3   # no copy
    assert t.held_tokens() == 10
    # the first sample writes its 11th token into the shared page 2: it gets its own copy of that page only
    pairs = t.writable(samples[0], 10, 1)
    assert pairs == [(2, 3)] and t.pages[samples[0]] == [0, 1, 3] and t.pool.refs[2] == 3
    assert t.writable(samples[0], 11, 1) == []                        # its own page now: no copy
    # another writes 4 tokens: a copy of page 2 and a fresh page 4 for the rest
    assert t.writable(samples[1], 10, 4) == [(2, 5)] and t.pages[samples[1]][2:] == [5, 4]
    t.commit(samples[0], 12)
    # pages 0-1 once (8), page 2 (2), sample 0's page 3 (4), sample 1's copy 5 (2; its page 4 holds nothing yet)
    assert t.held_tokens() == 8 + 2 + 4 + 2
    for r in (prompt, *samples):
        t.release(r)
    assert t.pool.free == 16 and t.pool.refs == [0] * 16


def test_a_write_that_cannot_be_held_changes_nothing():
    t = BlockTables(PagePool(3, page_size=4))
    a = t.add_row()
    assert t.reserve(a, 6)
    t.commit(a, 6)
    b = t.fork(a, 1)[0]
    assert t.writable(b, 6, 2) == [(1, 2)]                             # copy of page 1 takes the last free page
    c = t.fork(a, 1)[0]
    before = (list(map(list, t.pages)), list(t.pool.refs), t.pool.free)
    assert t.writable(c, 6, 2) is None                                 # a copy needed, no page free
    assert (list(map(list, t.pages)), list(t.pool.refs), t.pool.free) == before


def test_slots_and_the_block_table_read_through_the_pages():
    t = BlockTables(PagePool(8, page_size=4))
    a, b = t.add_row(), t.add_row()
    assert t.reserve(a, 3) and t.reserve(b, 9) and t.reserve(a, 6)    # a: pages 0, 4; b: pages 1, 2, 3
    assert t.pages[a] == [0, 4] and t.pages[b] == [1, 2, 3]
    assert t.slots(a, 2, 4).tolist() == [2, 3, 16, 17]
    assert t.slots(b, 7, 2).tolist() == [11, 12]
    assert t.table().tolist() == [[0, 4, -1], [1, 2, 3]] and t.table().dtype == torch.int32
    assert t.table([b], width=4).tolist() == [[1, 2, 3, -1]]
    with pytest.raises(ValueError, match="row 1 holds 3 pages, more than the table's width 2"):
        t.table(width=2)
    with pytest.raises(ValueError, match="row 0: slots up to token 9 asked, 8 reserved"):
        t.slots(a, 5, 4)
    assert pages_for(0, 4) == 0 and pages_for(9, 4) == 3


def test_rows_growing_in_lockstep_keep_runs_of_consecutive_pages():
    """Decode rows take a page each in turn; lowest-first they would interleave (0, 4, 8, ... for row 0), in runs
    each row's pages follow each other, a new run starting where a whole run is free."""
    t = BlockTables(PagePool(64, page_size=2, run=8))
    rows = [t.add_row() for _ in range(4)]
    for length in range(1, 33):                                        # 16 pages each, one token at a time
        for r in rows:
            assert t.reserve(r, length)
            t.commit(r, length)
    for r in rows:
        held = t.pages[r]
        assert held == sorted(held) and held[7] == held[0] + 7 and held[15] == held[8] + 7   # two whole runs
    assert sorted(p for r in rows for p in t.pages[r]) == list(range(64))


def test_a_runs_free_pages_go_to_other_rows_when_no_whole_run_is_left():
    pool = PagePool(16, page_size=4, run=8)
    a, b = pool.take(1), pool.take(1)
    assert (a, b) == ([0], [8])                                        # each starts a run
    assert pool.take(1, after=a[0]) == [1]                             # a row's next page: the one after its last
    assert pool.take(13) is not None and pool.free == 0        # no run left whole: any free page, never withheld
    assert pool.take(1) is None


def test_pages_are_never_lost_or_held_twice_under_random_takes_and_give_backs():
    rng = torch.Generator().manual_seed(0)
    pool = PagePool(37, page_size=4, run=8)                           # a short last run
    held: list[int] = []
    for _ in range(2000):
        if held and torch.rand(1, generator=rng).item() < 0.5:
            i = int(torch.randint(len(held), (1,), generator=rng))
            pool.give_back([held.pop(i)])
            continue
        n = int(torch.randint(1, 6, (1,), generator=rng))
        after = held[-1] if held and torch.rand(1, generator=rng).item() < 0.7 else None
        got = pool.take(n, after)
        assert (got is None) == (n > 37 - len(held))                   # refused only when too few are free
        held += got or []
        assert len(set(held)) == len(held) and pool.free == 37 - len(held) == pool.refs.count(0)
