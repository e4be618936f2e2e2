// What one work item of the C++ attention kernels is (csrc/attention.cpp): the call's arguments, the key rows a
// query token sees, the item's query heads and how they are loaded into vector lanes.
#pragma once

#include "cpu.h"

#include <algorithm>
#include <cstdint>

namespace sparseops_attn {

using sparseops_simd::Vec;

// the most keys of one unit of work (attention_tiles.h)
constexpr int64_t KEY_BLOCK = 64;

template <typename T> struct Args {
  const T *q, *k, *v;
  const int64_t *topk, *kv_start, *seq_len, *pos;
  const int64_t *lo = nullptr, *hi = nullptr;  // range mode (topk null): token t sees key rows [lo[t], hi[t])
  int64_t T1, N1, N2, D, Dv, K, bs, G, HB;
  int64_t R;  // flat key rows, T2 * N2
  bool causal;
  T floor;  // the lowest exponent computed (sparseops._numerics.exp_floor)
  T qscale;  // the softmax scale, applied to q as it is loaded
};

// The key blocks of token t's sequence, ceil(S2 / bs): a block id outside [0, count) is an empty slot, as on the
// torch and Triton paths.
template <typename T> int64_t block_count(const Args<T>& a, int64_t t) { return (a.seq_len[t] + a.bs - 1) / a.bs; }

// Whether block id idx lies in [0, count): one unsigned compare, made before idx * bs, which a huge id (2^60)
// overflows into a row before k or dK.
inline bool live_block(int64_t idx, int64_t count) {
  return static_cast<uint64_t>(idx) < static_cast<uint64_t>(count);
}

// The flat key rows ([T2 * N2] rows) item (t, n2) sees, in slot order, and when `slots` is given each row's slot
// (token granularity: one row per slot); returns their count.
template <typename T>
int64_t visible_rows(const Args<T>& a, int64_t t, int64_t n2, int64_t* rows, int64_t* slots = nullptr) {
  if (a.topk == nullptr) {
    const int64_t n = std::max<int64_t>(0, a.hi[t] - a.lo[t]);
    for (int64_t j = 0; j < n; ++j) rows[j] = (a.lo[t] + j) * a.N2 + n2;
    return n;
  }
  const int64_t* ids = a.topk + (t * a.N2 + n2) * a.K;
  int64_t lim = a.seq_len[t];
  if (a.causal) lim = std::min(lim, a.pos[t] + 1);
  const int64_t base = a.kv_start[t], blocks = block_count(a, t);
  int64_t n = 0;
  for (int64_t i = 0; i < a.K; ++i) {
    const int64_t idx = ids[i];
    if (!live_block(idx, blocks)) continue;
    const int64_t p0 = idx * a.bs, p1 = std::min(p0 + a.bs, lim);
    for (int64_t p = p0; p < p1; ++p) {
      if (slots != nullptr) slots[n] = i;
      rows[n++] = (base + p) * a.N2 + n2;
    }
  }
  return n;
}

// The item's heads: h0 = n2 * G + hb * W, Gh = min(W, G - hb * W) active lanes.
template <typename T> struct Heads {
  int64_t h0, Gh;
  Heads(int64_t G, int64_t n2, int64_t hb) : h0(n2 * G + hb * Vec<T>::W),
      Gh(std::min<int64_t>(Vec<T>::W, G - hb * Vec<T>::W)) {}
};

// xT[d][lane] = mul * src[t, h0 + lane, d] (0 on the inactive lanes); rows [W, D] of the same when N is given.
template <typename T>
void load_heads(const T* src, int64_t t, int64_t N1, int64_t D, const Heads<T>& h, typename Vec<T>::type* xT,
                T* N, T mul) {
  const T* base = src + (t * N1 + h.h0) * D;
  sparseops_simd::rows_to_lanes<T>(base, h.Gh, D, D, mul, xT);
  if (N != nullptr) {
    for (int64_t i = 0; i < h.Gh * D; ++i) N[i] = base[i] * mul;
    std::fill(N + h.Gh * D, N + Vec<T>::W * D, T(0));
  }
}

}  // namespace sparseops_attn
