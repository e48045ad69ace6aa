"""The KV page allocator (host only): allocation, refusal when short, refcounts, the dummy page."""

from __future__ import annotations

import pytest

from jaxbatch.core.kv_pages import DUMMY_PAGE, PageAllocator


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
