// CPU kernel of paged prefill attention (float32 or bfloat16 q and caches; fp32 math): tiles of query tokens against chunks of
// kChunk cached positions with an online softmax (flash-attention order), reading K and V in
// place through the block table. Built on first use by kernel_backends/cpu/extension.py.
//
// Token t of a sequence with context_len c and q_len n new tokens sits at position
// c - n + t and attends positions 0 ..= that one (causal over the cached prefix and the new
// tokens), or with window > 0 the last `window` of them (positions p - window + 1 ..= p).
// Scores are soft-capped (softcap · tanh(s / softcap)) when softcap > 0. A work item is
// (sequence, KV head, tile of up to kTile tokens): its rows are the tile's tokens × the KV
// head's query heads, which all read the same K/V chunk, in register tiles of six rows and
// one of the rest (1-5). Per chunk, S = Q·Kᵀ reads the key rows in place, each score in the
// one fixed order of attention_scores.h; O += P·V reads each V vector once for the tile's
// rows, each output in one fixed order (attention_values.h). Positions past a tile's last
// token are never read.
//
// Batch invariance: a query row's result is a function of its own query and its context
// only. The key chunks sit at absolute positions (multiples of kChunk from 0), whatever the
// tile or the step the token came in, so a row sums the same chunks in the same order alone,
// beside other tokens of its tile (masked positions add exact zeros, a chunk it cannot see
// leaves it as it was), in any chunked-prefill split, on a prefix-cache hit, and as a
// one-token decode: the backend runs decodes here too (kernel_backends/cpu/attention.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_scores.h"
#include "attention_values.h"
#include "online_softmax.h"
#include "vec.h"

namespace {

constexpr int64_t kTile = 32;  // query tokens per work item
constexpr int64_t kChunk = 64;  // key positions per step (any block size)
constexpr int64_t kRows = 6;    // rows per register tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
using loraplex_scores::dot_scores;
using loraplex_scores::kPositions;
using loraplex_values::accumulate_rows;

struct Item {
  int64_t seq, kv_head, t0, t1, cost;
};

// One thread's scratch, every array 64-byte aligned (vector loads never split a cache line).
// The storage is the thread's own and kept from call to call (it only grows), so a call
// neither allocates it nor faults its pages in.
struct Buffers {
  float *q, *o, *s, *m, *l, *alpha;
  Buffers(int64_t rows, int64_t dim) {
    thread_local std::vector<float> storage;
    const int64_t sizes[] = {rows * dim, rows * dim, rows * kChunk, rows, rows, rows};
    int64_t total = 16;
    for (int64_t n : sizes) total += (n + 15) / 16 * 16;
    if (static_cast<int64_t>(storage.size()) < total) storage.resize(total);
    float* next = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
    float** slots[] = {&q, &o, &s, &m, &l, &alpha};
    for (int i = 0; i < 6; ++i) {
      *slots[i] = next;
      next += (sizes[i] + 15) / 16 * 16;
    }
  }
};

// The chunk's key and value rows k[j], v[j] (pointers into the cache, read in place) for
// the positions p0 + j <= last_pos; k is padded to a multiple of kPositions with the last
// row (their scores are computed, then masked: softmax_rows' blend, not arithmetic).
// Returns the positions loaded. The first `ahead` bytes from each row's start are requested
// at once: a decode step's K and V were evicted by the step's weights, and read row by row
// each miss waited on the one before (Llama-3.2-1B's shapes, 80 positions after an int4
// GEMM: 63 us a layer, 30 with the rows cached first). The caller asks for its own head's
// row, or (KV head 0) the position's rows of every head: one stream where the other heads'
// items would each read their few lines of it.
template <typename scalar_t>
int64_t load_chunk(const scalar_t* k_base, const scalar_t* v_base, const int32_t* table,
                   int64_t bs, int64_t blk_stride, int64_t row_stride, int64_t ahead,
                   int64_t p0, int64_t last_pos, const scalar_t** k, const scalar_t** v) {
  const int64_t n = std::min(kChunk, last_pos + 1 - p0);
  int64_t block = p0 / bs, in_block = p0 % bs;  // stepped, not divided, position by position
  for (int64_t j = 0; j < n; ++j) {
    k[j] = k_base + table[block] * blk_stride + in_block * row_stride;
    v[j] = v_base + (k[j] - k_base);
    for (int64_t b = 0; b < ahead; b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k[j]) + b, 0, 3);
      __builtin_prefetch(reinterpret_cast<const char*>(v[j]) + b, 0, 3);
    }
    if (++in_block == bs) in_block = 0, ++block;
  }
  for (int64_t j = n; j % kPositions; ++j) k[j] = k[n - 1];
  return n;
}

// The chunk a register tile reads: its key and value rows from position p0, and the
// item's head_dim, soft-cap and window.
template <typename scalar_t>
struct ChunkTile {
  const scalar_t* const* k;
  const scalar_t* const* v;
  int64_t p0, dim;
  float softcap;
  int64_t window;
};

// One chunk for R rows (a register tile) at positions pos[0..R): scores, mask, online
// softmax, P·V. keys: the positions p0 .. p0 + keys - 1 the tile reads (up to its last
// row's position). Row i's arithmetic depends only on its own q, position and the chunk.
template <int R, typename scalar_t>
void chunk_rows(const ChunkTile<scalar_t>& c, const int64_t* pos, int64_t keys, float* q,
                float* s, float* m, float* l, float* alpha, float* o) {
  const int64_t width = (keys + 7) / 8 * 8;
  dot_scores<R>(q, c.dim, c.k, (keys + kPositions - 1) / kPositions * kPositions, s, kChunk);
  int64_t vis_lo[R], vis_hi[R];  // row i sees positions p0 + [lo, hi)
  for (int64_t i = 0; i < R; ++i) {
    float* row = s + i * kChunk;
    if (c.softcap > 0)
      for (int64_t j = 0; j < width; ++j) row[j] = std::tanh(row[j] / c.softcap) * c.softcap;
    // visible: p0 + j <= pos (causal), and p0 + j > pos - window with a window
    vis_hi[i] = std::clamp<int64_t>(pos[i] + 1 - c.p0, 0, width);
    vis_lo[i] = c.window > 0 ? std::clamp<int64_t>(pos[i] - c.window + 1 - c.p0, 0, width) : 0;
  }
  softmax_rows<R, kChunk>(s, width, vis_lo, vis_hi, m, l, alpha);
  accumulate_rows<R, kChunk>(s, c.v, c.dim, keys, alpha, o);
}

// A work item's rows in register tiles of kRows, the last one of rows % kRows (no pad
// rows: a decode's KV-head group of 2-5 query heads is one tile of its own size).
template <typename scalar_t>
void tile_attention(const Item& it, const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const int32_t* table, int64_t first_pos,
                    double scale, float softcap, int64_t window, Buffers& b,
                    torch::Tensor& out) {
  const int64_t num_heads = q.size(1), dim = q.size(2), group = num_heads / k_cache.size(2);
  const int64_t rows = (it.t1 - it.t0) * group;
  const int64_t q_token = q.stride(0), q_head = q.stride(1);  // q rows may be strided
  const scalar_t* q_p = q.data_ptr<scalar_t>();
  for (int64_t r = 0; r < rows; ++r) {  // row r = (token t0 + r / group, head r % group)
    const scalar_t* src =
        q_p + (it.t0 + r / group) * q_token + (it.kv_head * group + r % group) * q_head;
    for (int64_t d = 0; d < dim; ++d)
      b.q[r * dim + d] = static_cast<float>(src[d]) * static_cast<float>(scale);
  }
  std::fill(b.o, b.o + rows * dim, 0.f);
  std::fill(b.m, b.m + rows, kNegInf);
  std::fill(b.l, b.l + rows, 0.f);
  const scalar_t* k_base = k_cache.data_ptr<scalar_t>() + it.kv_head * k_cache.stride(2);
  const scalar_t* v_base = v_cache.data_ptr<scalar_t>() + it.kv_head * v_cache.stride(2);
  const scalar_t *k_rows[kChunk], *v_rows[kChunk];
  const int64_t ahead = (it.kv_head == 0 ? k_cache.stride(1) : dim) *
                        static_cast<int64_t>(sizeof(scalar_t));  // load_chunk's requests
  const int64_t last_pos = first_pos + it.t1 - 1;  // the tile's last token's position
  // the tile's first token's window starts the positions read (whole chunks from there)
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + it.t0 - window + 1) : 0;
  for (int64_t p0 = lo / kChunk * kChunk; p0 <= last_pos; p0 += kChunk) {
    load_chunk(k_base, v_base, table, k_cache.size(1), k_cache.stride(0), k_cache.stride(1),
               ahead, p0, last_pos, k_rows, v_rows);
    const ChunkTile<scalar_t> chunk{k_rows, v_rows, p0, dim, softcap, window};
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t n = std::min(kRows, rows - r0);
      int64_t pos[kRows];  // row r0 + i's token's position
      for (int64_t i = 0; i < n; ++i) pos[i] = first_pos + it.t0 + (r0 + i) / group;
      // the register tile's keys: up to its last row's position (causal); a tile that sees
      // none of this chunk's positions is left as it is (its rows would add 0, scale by 1)
      const int64_t keys = std::min(kChunk, pos[n - 1] + 1 - p0);
      if (keys <= 0) continue;
      float *q_r = b.q + r0 * dim, *s = b.s + r0 * kChunk, *o = b.o + r0 * dim;
      float *m = b.m + r0, *l = b.l + r0, *alpha = b.alpha + r0;
      switch (n) {
        case 6: chunk_rows<6>(chunk, pos, keys, q_r, s, m, l, alpha, o); break;
        case 5: chunk_rows<5>(chunk, pos, keys, q_r, s, m, l, alpha, o); break;
        case 4: chunk_rows<4>(chunk, pos, keys, q_r, s, m, l, alpha, o); break;
        case 3: chunk_rows<3>(chunk, pos, keys, q_r, s, m, l, alpha, o); break;
        case 2: chunk_rows<2>(chunk, pos, keys, q_r, s, m, l, alpha, o); break;
        default: chunk_rows<1>(chunk, pos, keys, q_r, s, m, l, alpha, o); break;
      }
    }
  }
  scalar_t* out_p = out.data_ptr<scalar_t>();
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* dst = out_p + ((it.t0 + r / group) * num_heads + it.kv_head * group + r % group) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(b.o[r * dim + d] / b.l[r]);
  }
}

// The work items, ordered so that at::parallel_for's contiguous per-thread ranges carry
// about equal cost: the (sequence, tile) groups sorted by cost (rows × positions read; a
// stable sort: equal groups keep the sequences' order), dealt out in a snake order (the
// ranges' bounds may shift an item from one thread's share to the next one's). A group's
// KV heads stay together, in order: they read the same cached rows' neighbouring bytes, so
// the lines one head's read brings in serve the next (a decode step's K/V comes from memory).
std::vector<Item> balanced_items(const int32_t* starts, const int32_t* lens, int64_t seqs,
                                 int64_t kv_heads, int64_t group) {
  std::vector<Item> groups;  // kv_head 0 stands for the group's heads
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t n = starts[s + 1] - starts[s], first = lens[s] - n;
    if (n < 1) continue;  // nothing new (one-token sequences, decodes, run here too)
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      const int64_t t1 = std::min(n, t0 + kTile);
      groups.push_back({s, 0, starts[s] + t0, starts[s] + t1, (t1 - t0) * group * (first + t1)});
    }
  }
  std::stable_sort(groups.begin(), groups.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<std::vector<Item>> dealt(threads);
  for (size_t i = 0; i < groups.size(); ++i) {  // round i / threads goes in snake order
    const int64_t round = i / threads, k = i % threads;
    dealt[round % 2 ? threads - 1 - k : k].push_back(groups[i]);
  }
  std::vector<Item> ordered;
  for (const auto& part : dealt)
    for (const Item& g : part)
      for (int64_t h = 0; h < kv_heads; ++h) ordered.push_back({g.seq, h, g.t0, g.t1, g.cost});
  return ordered;
}

}  // namespace

torch::Tensor paged_attention_prefill(torch::Tensor q, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_tables,
                                      torch::Tensor query_start_loc, torch::Tensor context_lens,
                                      double scale, double softcap, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK((q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16) &&
                  k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "float32 or bfloat16 q and caches of one dtype only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, Hq, D] with dense rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.strides() == v_cache.strides() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.stride(3) == 1,
              "k and v caches must share a [NB, bs, Hkv, D] layout with dense rows");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "q heads do not match the cache");
  TORCH_CHECK(softcap >= 0 && window >= 0, "softcap and window must be >= 0 (0 = off)");
  const int64_t seqs = context_lens.size(0);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == torch::kInt32 && context_lens.is_contiguous() &&
                  query_start_loc.scalar_type() == torch::kInt32 &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == seqs + 1 &&
                  block_tables.size(0) == seqs,
              "block_tables [S, max_blocks], query_start_loc [S + 1], context_lens [S]: int32");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t bs = k_cache.size(1), max_blocks = block_tables.size(1);
  TORCH_CHECK(starts[0] == 0 && starts[seqs] == q.size(0), "query_start_loc must span q");
  for (int64_t s = 0; s < seqs; ++s) {  // the kernel indexes memory with these
    const int64_t n = starts[s + 1] - starts[s];
    TORCH_CHECK(n >= 0 && n <= lens[s] && (lens[s] + bs - 1) / bs <= max_blocks,
                "sequence ", s, ": ", n, " new tokens, context ", lens[s],
                " do not fit the block table");
    for (int64_t j = 0; n > 0 && j < (lens[s] + bs - 1) / bs; ++j)
      TORCH_CHECK(tables[s * max_blocks + j] >= 0 && tables[s * max_blocks + j] < k_cache.size(0),
                  "block ", tables[s * max_blocks + j], " out of range");
  }
  auto out = torch::empty(q.sizes(), q.options());  // dense, whatever q's strides
  const int64_t kv_heads = k_cache.size(2), group = q.size(1) / kv_heads, dim = q.size(2);
  const std::vector<Item> items = balanced_items(starts, lens, seqs, kv_heads, group);
  at::parallel_for(0, items.size(), 1, [&](int64_t begin, int64_t end) {
    Buffers buffers((kTile * group + kRows - 1) / kRows * kRows, dim);
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int64_t first_pos = lens[it.seq] - (starts[it.seq + 1] - starts[it.seq]) - starts[it.seq];
      if (q.scalar_type() == torch::kFloat)
        tile_attention<float>(it, q, k_cache, v_cache, tables + it.seq * max_blocks, first_pos,
                              scale, static_cast<float>(softcap), window, buffers, out);
      else
        tile_attention<c10::BFloat16>(it, q, k_cache, v_cache, tables + it.seq * max_blocks,
                                      first_pos, scale, static_cast<float>(softcap), window,
                                      buffers, out);
    }
  });
  return out;
}
