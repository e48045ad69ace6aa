// How a panel-mode call splits its output into work items: the same for the AVX512-BF16 form
// (quant_panel.cc) and the AVX2 one (quant_panel_avx2.cc); only their sizes differ.

#pragma once

#include <algorithm>
#include <cstdint>

namespace jaxbatch_quant {

struct PanelSizes {
  int64_t few_rows;    // up to this many rows: the decode path
  int64_t block_cols;  // prefill: columns a block
  int64_t chunk_k;     // prefill: K a chunk of the block
  int64_t tile_rows;   // prefill: rows a register tile
  int64_t x_elt;       // prefill: bytes of one x element as the tiles read it (bf16 2, f32 4)
};

// Sets j.chunk and j.items for decode (M <= few_rows: claims of up to 4 panels of 16 columns,
// fewer where that would leave a thread idle), or j.ncb, j.segrows and j.items for prefill
// ((column block, row segment) items; a segment's x chunk stays in L2 beside the block's chunk,
// ~384 KB, and there are more segments where too few column blocks would leave threads idle).
template <class Job>
void PlanPanelItems(Job& j, const PanelSizes& s, int64_t threads) {
  if (j.M <= s.few_rows) {
    const int64_t panels = j.N / 16;
    j.chunk = 16 * std::max<int64_t>(1, std::min<int64_t>(4, panels / (4 * threads)));
    j.items = (j.N + j.chunk - 1) / j.chunk;
    return;
  }
  j.ncb = (j.N + s.block_cols - 1) / s.block_cols;
  const int64_t kc = std::min(j.K, s.chunk_k);
  const int64_t by_cache =
      std::max<int64_t>(16, (384 << 10) / (kc * s.x_elt + s.block_cols * 4));
  const int64_t want = 2 * threads;
  const int64_t by_threads = j.ncb >= want ? j.M : (j.M * j.ncb + want - 1) / want;
  const int64_t rows = std::max<int64_t>(s.tile_rows, std::min(by_cache, by_threads));
  j.segrows = (rows + s.tile_rows - 1) / s.tile_rows * s.tile_rows;
  j.items = j.ncb * ((j.M + j.segrows - 1) / j.segrows);
}

}  // namespace jaxbatch_quant
