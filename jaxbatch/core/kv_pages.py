"""The KV page allocator and its prefix cache (host only: never imports jax).

Pages hold `page_size` tokens. Page 0 is the dummy page: padding tokens write their KV there and
padding sequences point at it, so the kernels never special-case padding.

Every other page is in exactly one of three states (`check()` asserts it after every step):
  used    ref_count > 0: in the page table of one or more running requests (shared by a
          prefix-cache hit or by the choices of one prompt, `share`)
  cached  ref_count 0, holding the KV of a full page that is in the prefix cache: kept until its
          memory is needed, then evicted least recently used first
  empty   ref_count 0, nothing worth keeping
An allocation takes empty pages first, then evicts cached ones (LRU); a used page is never
evicted. `num_free_pages` counts empty + cached: the memory an allocation can take (vLLM's
"free" too, so KV usage does not count pages that only cache).

Automatic prefix caching (vLLM's APC). A full page is named by a hash chain:
  hash(page k) = H(hash(page k-1), the page's token ids),  hash(page -1) = H(extra key)
so a hash stands for the whole prefix up to the page's end, and two requests with the same first
k pages of tokens (and the same extra key: anything else that changes the KV, e.g. a LoRA or
model id) have the same k hashes. H is 128-bit BLAKE2b over the token ids as int64: collisions are
not a practical concern, and the names are stable across processes. The scheduler
  - looks up a waiting request's pages (`match`) and shares the hits (`allocate(..., cached=)`),
  - enters each page into the cache once it is full and its KV computed (`cache_page`), never
    before: a page is written by exactly one request, before anyone can share it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from jaxbatch.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

DUMMY_PAGE = 0
PageHash = bytes


def root_hash(extra_key: str = "") -> PageHash:
    """The hash chain's seed: anything besides the token ids that changes the KV."""
    return hashlib.blake2b(b"jaxbatch-prefix-v1\0" + extra_key.encode(), digest_size=16).digest()


def extend_page_hashes(hashes: list[PageHash], token_ids: Sequence[int], page_size: int,
                       extra_key: str = "") -> list[PageHash]:
    """Extend a sequence's hash chain `hashes` (in place) by the full pages of `token_ids`, the
    tokens that follow its last hashed page (a multiple of page_size of them). Returns `hashes`."""
    assert len(token_ids) % page_size == 0, (len(token_ids), page_size)
    parent = hashes[-1] if hashes else root_hash(extra_key)
    for k in range(0, len(token_ids), page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", token_ids[k : k + page_size]).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = False) -> None:
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages (one is the dummy page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_pages
        self.ref_counts[DUMMY_PAGE] = 1  # never handed out, never freed
        self.empty_pages: deque[int] = deque(range(1, num_pages))
        self.page_hash: list[PageHash | None] = [None] * num_pages
        self.cached: dict[PageHash, int] = {}  # hash -> the page holding it (used or not)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; LRU first
        # prefix-cache counters, in tokens (vLLM's): looked up at admission, served from the cache
        self.queries = 0
        self.hits = 0
        # the cache's changes as KV-cache events (core/kv_events.py), kept only when a publisher
        # takes them (engine/kv_events.py: `take_events` after every step)
        self.record_events = False
        self.events: list[KVCacheEvent] = []

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take: empty + cached (evictable)."""
        return len(self.empty_pages) + len(self.evictable)

    @property
    def num_cached_pages(self) -> int:
        """Unreferenced pages kept for the prefix cache (part of num_free_pages)."""
        return len(self.evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - 1 - self.num_free_pages

    # ---- allocation ---------------------------------------------------------------------------
    def pages_needed(self, page_table: list[int], num_tokens: int) -> int:
        """Extra pages a sequence holding `page_table` needs to store `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.page_size) - len(page_table))

    def can_allocate(self, page_table: list[int], num_tokens: int) -> bool:
        return self.pages_needed(page_table, num_tokens) <= self.num_free_pages

    def allocate(self, page_table: list[int], num_tokens: int,
                 cached: Sequence[int] = ()) -> bool:
        """Grow page_table (in place) to hold num_tokens tokens: first the `cached` pages (a
        prefix-cache hit from `match`, shared: one more reference each), then new pages.
        False (and no change) if short."""
        assert not cached or not page_table, "a cache hit starts an empty page table"
        need = self.pages_needed(page_table, num_tokens) - len(cached)
        reclaimed = sum(1 for p in cached if self.ref_counts[p] == 0)  # leave the free pool
        if max(0, need) > self.num_free_pages - reclaimed:
            return False
        for page in cached:
            assert self.page_hash[page] is not None, page
            if self.ref_counts[page] == 0:
                del self.evictable[page]
            self.ref_counts[page] += 1
            page_table.append(page)
        for _ in range(need):
            page = self._take_page()
            self.ref_counts[page] = 1
            page_table.append(page)
        return True

    def share(self, pages: Sequence[int]) -> list[int]:
        """A new page table holding `pages` (used by another sequence), one more reference each:
        a choice forked off its parent's prompt (core/parallel_sampling.py). Neither sequence
        writes them again, so they need no copy."""
        for page in pages:
            assert page != DUMMY_PAGE and self.ref_counts[page] > 0, (page, self.ref_counts[page])
            self.ref_counts[page] += 1
        return list(pages)

    def _take_page(self) -> int:
        if self.empty_pages:
            page = self.empty_pages.popleft()
        else:  # evict the least recently used cached page
            page, _ = self.evictable.popitem(last=False)
            h = self.page_hash[page]
            assert h is not None and self.cached[h] == page, page
            del self.cached[h]
            self.page_hash[page] = None
            if self.record_events:
                self.events.append(BlockRemoved((h,)))
        assert self.ref_counts[page] == 0, (page, self.ref_counts[page])
        return page

    def free(self, page_table: list[int]) -> None:
        """Release every page of a sequence (in place: page_table becomes empty). A cached page
        whose last reference goes stays cached; the sequence's tail goes first in the LRU order
        (a prefix is worth more than its continuation, which is useless without it)."""
        for page in reversed(page_table):
            assert page != DUMMY_PAGE and self.ref_counts[page] > 0, (page, self.ref_counts[page])
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if self.page_hash[page] is None:
                    self.empty_pages.appendleft(page)
                else:
                    self.evictable[page] = None
        page_table.clear()

    def truncate(self, page_table: list[int], num_tokens: int) -> None:
        """Release the pages past those `num_tokens` tokens need (in place): a speculative
        step's rejected proposals. Only a sequence's private tail pages (never cached: not
        full of accepted tokens) can be past that."""
        keep = -(-num_tokens // self.page_size)
        if len(page_table) > keep:
            tail = page_table[keep:]
            del page_table[keep:]
            self.free(tail)

    # ---- prefix cache -------------------------------------------------------------------------
    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """The cached pages of the longest prefix of `hashes` (no reference taken: pass them to
        `allocate(..., cached=)`). Empty when caching is off."""
        if not self.enable_caching:
            return []
        pages = []
        for h in hashes:
            page = self.cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def cache_page(self, page: int, page_hash: PageHash, parent_hash: PageHash | None = None,
                   token_ids: Sequence[int] = (), lora_id: int | None = None) -> None:
        """Enter a full page whose KV is computed into the cache. A no-op when caching is off,
        the page is cached already, or another page holds the same prefix (two requests computed
        it in the same step: the duplicate stays private and is freed as an empty page).
        `parent_hash` (the previous page's; None for a sequence's first) and the page's
        `token_ids` go into its BlockStored event, with `lora_id` (the adapter load whose KV
        it holds; None: the base model)."""
        if not self.enable_caching or self.page_hash[page] is not None \
                or page_hash in self.cached:
            return
        assert page != DUMMY_PAGE and self.ref_counts[page] > 0, (page, self.ref_counts[page])
        self.page_hash[page] = page_hash
        self.cached[page_hash] = page
        if self.record_events:
            self.events.append(BlockStored((page_hash,), parent_hash, tuple(token_ids),
                                           self.page_size, lora_id))

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def reset_prefix_cache(self) -> int:
        """Forget every cached page no request uses (e.g. between benchmark runs); pages in use
        stay cached. Returns how many pages were emptied."""
        n = len(self.evictable)
        gone = []
        for page in self.evictable:
            h = self.page_hash[page]
            assert h is not None
            del self.cached[h]
            gone.append(h)
            self.page_hash[page] = None
            self.empty_pages.append(page)
        self.evictable.clear()
        if self.record_events and gone:
            self.events.append(BlockRemoved(tuple(gone)))
        return n

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (oldest first)."""
        out, self.events = self.events, []
        return out

    def start_events(self) -> None:
        """Record events from now on (before the first request: nothing is cached yet),
        starting with AllBlocksCleared: a subscriber forgets what an earlier engine on this
        endpoint said."""
        assert not self.cached, "events start before anything is cached"
        self.record_events = True
        self.events = [AllBlocksCleared()]

    # ---- invariants ---------------------------------------------------------------------------
    def check(self) -> None:
        """empty + cached + used == total (the dummy page aside), and the cache's maps agree."""
        used = sum(1 for p in range(1, self.num_pages) if self.ref_counts[p] > 0)
        empty, evictable = len(self.empty_pages), len(self.evictable)
        assert used + empty + evictable == self.num_pages - 1, (used, empty, evictable)
        assert len(set(self.empty_pages)) == empty, "a page is empty twice"
        assert all(self.ref_counts[p] == 0 and self.page_hash[p] is None
                   for p in self.empty_pages), "an empty page is referenced or cached"
        assert all(self.ref_counts[p] == 0 and self.page_hash[p] is not None
                   for p in self.evictable), "an evictable page is referenced or not cached"
        assert all(self.page_hash[p] == h for h, p in self.cached.items()), "cache maps disagree"
        assert sum(h is not None for h in self.page_hash) == len(self.cached), "stray page hash"
        assert self.page_hash[DUMMY_PAGE] is None and self.ref_counts[DUMMY_PAGE] == 1
        assert self.hits <= self.queries, (self.hits, self.queries)
