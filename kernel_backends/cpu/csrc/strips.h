// How the panel GEMMs (panel_gemm.cpp, panel_gemm_bf16.cpp) share M rows of x out over
// S = ceil(M / rows-per-tile) strips.
#pragma once

#include <algorithm>
#include <cstdint>

// Strip s of S holds rows strip_start(s) .. strip_start(s + 1) - 1: M rows shared out as
// evenly as S strips allow (32 rows in strips of up to 6: 6, 6, 5, 5, 5, 5, not five of 6
// and one of 2, whose two-row tile waits on its FMA latency). Any split gives each row the
// same FMAs.
inline int64_t strip_start(int64_t s, int64_t M, int64_t S) {
  const int64_t base = M / S, extra = M % S;  // the first `extra` strips take base + 1
  return s * base + std::min(s, extra);
}
