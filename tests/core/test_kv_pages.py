"""The KV page allocator (host only): allocation, refusal when short, refcounts, the dummy page,
and the prefix cache (hash chain, sharing, LRU eviction of unreferenced pages only)."""

from __future__ import annotations

import pytest

from jaxbatch.core.kv_pages import DUMMY_PAGE, PageAllocator, extend_page_hashes


def test_page_allocator_refcounts():
    pages = PageAllocator(10, 4)
    t: list[int] = []
    assert pages.allocate(t, 9) and len(t) == 3
    assert not pages.allocate([], 4 * 7)  # only 6 left
    assert pages.num_used_pages == 3
    pages.free(t)
    assert t == [] and pages.num_used_pages == 0
    pages.check()


def test_dummy_page_is_never_handed_out_or_freed():
    pages = PageAllocator(3, 1)
    t: list[int] = []
    assert pages.allocate(t, 2) and DUMMY_PAGE not in t
    assert not pages.allocate(t, 3)  # the dummy page does not count as free
    with pytest.raises(AssertionError):
        pages.free([DUMMY_PAGE])
    with pytest.raises(ValueError, match="at least 2"):
        PageAllocator(1, 16)


# ---- prefix cache -----------------------------------------------------------------------------
def test_hash_chain_names_the_whole_prefix():
    a = extend_page_hashes([], [1, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(set(a)) == 3
    assert extend_page_hashes([], [1, 2, 3, 4], 2) == a[:2]  # same prefix, same names
    assert extend_page_hashes(a[:1], [3, 4, 5, 6], 2) == a  # grows incrementally
    b = extend_page_hashes([], [9, 9, 3, 4], 2)
    assert b[0] != a[0] and b[1] != a[1]  # same page tokens, different parent
    assert extend_page_hashes([], [1, 2], 2, extra_key="lora-1")[0] != a[0]  # the extra key
    with pytest.raises(AssertionError):
        extend_page_hashes([], [1, 2, 3], 2)  # only full pages have names


def _computed(pages: PageAllocator, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """A sequence that computed `tokens` and entered its full pages into the cache."""
    table: list[int] = []
    assert pages.allocate(table, len(tokens))
    hashes = extend_page_hashes([], tokens[: len(tokens) // pages.page_size * pages.page_size],
                                pages.page_size)
    for page, h in zip(table, hashes):
        pages.cache_page(page, h)
    return table, hashes


def test_cached_pages_are_shared_refcounted_and_kept_after_free():
    pages = PageAllocator(10, 4, enable_caching=True)
    a, hashes = _computed(pages, list(range(10)))  # 2 full pages + 1 partial
    assert pages.match(hashes) == a[:2]
    b: list[int] = []
    assert pages.allocate(b, 12, cached=pages.match(hashes))  # shares 2, adds 1
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [pages.ref_counts[p] for p in b] == [2, 2, 1]
    shared = b[:2]
    pages.free(a)
    assert pages.num_cached_pages == 0 and pages.num_used_pages == 3  # b still holds 2 + 1
    pages.free(b)
    assert pages.num_used_pages == 0 and pages.num_cached_pages == 2
    assert pages.num_free_pages == 9  # cached pages are free memory
    assert pages.match(hashes) == shared  # still there for the next request
    pages.check()


def test_eviction_takes_empty_pages_first_then_least_recently_used():
    pages = PageAllocator(1 + 4, 1, enable_caching=True)
    old, old_h = _computed(pages, [1, 2])
    new, new_h = _computed(pages, [3])
    old_pages, new_pages = list(old), list(new)
    pages.free(old)
    pages.free(new)
    assert pages.num_cached_pages == 3 and pages.num_free_pages == 4
    t: list[int] = []
    assert pages.allocate(t, 1)  # the one empty page
    assert pages.num_cached_pages == 3
    assert pages.allocate(t, 2)  # evicts the LRU: old's tail page (freed first)
    assert pages.match(old_h) == old_pages[:1] and pages.match(new_h) == new_pages
    assert pages.allocate(t, 3)  # then old's head
    assert pages.match(old_h) == [] and pages.match(new_h) == new_pages
    pages.check()


def test_pages_in_use_are_never_evicted_and_a_short_allocation_changes_nothing():
    pages = PageAllocator(1 + 3, 2, enable_caching=True)
    a, h = _computed(pages, [1, 2, 3, 4])  # 2 pages, in use
    before = (list(pages.ref_counts), pages.num_cached_pages)
    assert not pages.allocate([], 4)  # 1 free page, needs 2: nothing evicted, nothing taken
    b: list[int] = []
    assert not pages.allocate(b, 8, cached=pages.match(h))  # shares 2, needs 2 more: 1 free
    assert b == [] and (pages.ref_counts, pages.num_cached_pages) == before
    a_pages = list(a)
    pages.free(a)
    c: list[int] = []  # the hit's own pages are not free memory for the rest of its allocation
    assert not pages.allocate(c, 8, cached=pages.match(h))
    assert pages.allocate(c, 6, cached=pages.match(h)) and c[:2] == a_pages
    pages.check()


def test_duplicate_prefix_stays_private_and_caching_off_is_inert():
    pages = PageAllocator(8, 2, enable_caching=True)
    a, h = _computed(pages, [1, 2])
    b, _ = _computed(pages, [1, 2])  # computed the same page in the same step
    assert pages.match(h) == a and pages.page_hash[b[0]] is None and a != b
    pages.free(b)
    assert pages.num_cached_pages == 0  # the duplicate went back empty
    pages.free(a)
    assert pages.reset_prefix_cache() == 1 and pages.match(h) == []
    pages.check()
    off = PageAllocator(8, 2)
    t, h = _computed(off, [1, 2])
    assert off.match(h) == [] and off.page_hash[t[0]] is None
    off.free(t)
    assert off.num_cached_pages == 0
    off.check()
