"""The KV page allocator (host only: never imports jax).

Pages hold `page_size` tokens. Page 0 is the dummy page: padding tokens write their KV there and
padding sequences point at it, so the kernels never special-case padding. Pages are reference
counted (a page may one day be shared by a prefix cache); `check()` asserts free + used == total.
"""

from __future__ import annotations

from collections import deque

DUMMY_PAGE = 0


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages (one is the dummy page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_counts = [0] * num_pages
        self.ref_counts[DUMMY_PAGE] = 1  # never handed out, never freed
        self.free_pages: deque[int] = deque(range(1, num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - 1 - len(self.free_pages)

    def pages_needed(self, page_table: list[int], num_tokens: int) -> int:
        """Extra pages a sequence holding `page_table` needs to store `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(page_table))

    def can_allocate(self, page_table: list[int], num_tokens: int) -> bool:
        return self.pages_needed(page_table, num_tokens) <= len(self.free_pages)

    def allocate(self, page_table: list[int], num_tokens: int) -> bool:
        """Grow page_table (in place) to hold num_tokens tokens. False (and no change) if short."""
        need = self.pages_needed(page_table, num_tokens)
        if need > len(self.free_pages):
            return False
        for _ in range(need):
            page = self.free_pages.popleft()
            assert self.ref_counts[page] == 0, (page, self.ref_counts[page])
            self.ref_counts[page] = 1
            page_table.append(page)
        return True

    def free(self, page_table: list[int]) -> None:
        """Release every page of a sequence (in place: page_table becomes empty)."""
        for page in reversed(page_table):
            assert page != DUMMY_PAGE and self.ref_counts[page] > 0, (page, self.ref_counts[page])
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages.appendleft(page)
        page_table.clear()

    def check(self) -> None:
        used = sum(1 for p in range(1, self.num_pages) if self.ref_counts[p] > 0)
        assert used + len(self.free_pages) == self.num_pages - 1, (used, len(self.free_pages))
        assert len(set(self.free_pages)) == len(self.free_pages), "a page is free twice"
        assert all(self.ref_counts[p] == 0 for p in self.free_pages), "a free page is referenced"
