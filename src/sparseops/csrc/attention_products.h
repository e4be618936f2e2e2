// The products of the C++ attention kernels (csrc/attention.cpp; docs/nsa.md, "The C++ CPU path"): the G query
// heads of a KV head in the lanes of a 64-byte vector, key rows read in place by index. Each product runs as
// broadcast-FMAs:
//   scores  s[j]   = sum_d qT[d] * k_j[d]          (qT [D] vectors: q transposed)
//   outputs oT[d]  = sum_j p[j] * v_j[d]           (accumulators over d in registers)
//   key rows dk_j  += sum_h ds[j][h] * q_h         (d in the lanes, for dK and dV)
// The *2 forms take two query tokens that see the same rows: each loaded key element then serves two FMAs.
#pragma once

#include "cpu.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace sparseops_attn {

using sparseops_simd::load;
using sparseops_simd::prefetch_row;
using sparseops_simd::store;
using sparseops_simd::Vec;
using sparseops_simd::vexp;

// exp(x) with x clamped to [floor, 80] (sparseops._numerics.exp_floor: no denormal, no overflow); NaN stays NaN.
template <typename T> inline typename Vec<T>::type exp_clamped(typename Vec<T>::type x, T floor) {
  typedef typename Vec<T>::type V;
  x = x < floor ? V{} + floor : x;
  x = x > T(80) ? V{} + T(80) : x;
  return vexp(x);
}

// Each lane's softmax terms over the n scores s[j], in place: s[j] <- exp(s[j] - mx), mx the lane's max (an
// overflowed +inf score held at the largest finite value, NaN propagated, 0 for a lane of -inf); returns the
// lanes' sums.
template <typename T>
typename Vec<T>::type softmax_terms(typename Vec<T>::type* s, int64_t n, T floor, typename Vec<T>::type& mx) {
  typedef typename Vec<T>::type V;
  const T big = std::numeric_limits<T>::max(), ninf = -std::numeric_limits<T>::infinity();
  mx = V{} + ninf;
  for (int64_t j = 0; j < n; ++j) {
    V x = s[j];
    x = x > big ? V{} + big : x;
    s[j] = x;
    mx = (x > mx) | (x != x) ? x : mx;
  }
  mx = mx == ninf ? V{} : mx;
  V sum{};
  for (int64_t j = 0; j < n; ++j) {
    s[j] = exp_clamped<T>(s[j] - mx, floor);
    sum += s[j];
  }
  return sum;
}

// o[d] += sum_{h < Gh} xs[h] * A[h, d] for d in [d0, D), plus the same of ys and A1 when ys is given: one key row's
// update of row_scatter, without tiles.
template <typename T>
void scatter_key(T* o, const T* xs, const T* A, const T* ys, const T* A1, int64_t Gh, int64_t D, int64_t d0) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  for (; d0 + W <= D; d0 += W) {
    V a = load<T>(o + d0);
    for (int64_t h = 0; h < Gh; ++h) a += xs[h] * load<T>(A + h * D + d0);
    if (ys != nullptr)
      for (int64_t h = 0; h < Gh; ++h) a += ys[h] * load<T>(A1 + h * D + d0);
    store<T>(o + d0, a);
  }
  for (; d0 < D; ++d0) {
    T a = o[d0];
    for (int64_t h = 0; h < Gh; ++h) a += xs[h] * A[h * D + d0];
    if (ys != nullptr)
      for (int64_t h = 0; h < Gh; ++h) a += ys[h] * A1[h * D + d0];
    o[d0] = a;
  }
}

// row_scatter one key at a time.
template <typename T>
void row_scatter_keys(const typename Vec<T>::type* x, const T* A, int64_t Gh, int64_t D, T* dst,
                      const int64_t* rows, int64_t n, const typename Vec<T>::type* x1 = nullptr,
                      const T* A1 = nullptr) {
  for (int64_t j = 0; j < n; ++j)
    scatter_key<T>(dst + rows[j] * D, reinterpret_cast<const T*>(x + j), A,
                   x1 != nullptr ? reinterpret_cast<const T*>(x1 + j) : nullptr, A1, Gh, D, 0);
}

// a[c][i] += sum_{h < Gh} x[c][h] * A[h, i * W .. (i + 1) * W) for the C keys x[c] and the B vectors of the rows of A
// (stride D): one tile of row_scatter, its accumulators in registers.
template <typename T, int C, int B>
__attribute__((always_inline)) inline void scatter_tile(typename Vec<T>::type (&a)[C][B], const typename Vec<T>::type* x,
                                                        const T* A, int64_t Gh, int64_t D) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  const T* xs = reinterpret_cast<const T*>(x);
  for (int64_t h = 0; h < Gh; ++h) {
    const T* ah = A + h * D;
    V rv[B];
    for (int i = 0; i < B; ++i) rv[i] = load<T>(ah + i * W);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const T b = xs[c * W + h];  // a scalar: broadcast from memory (V{} + b adds in a register first)
#pragma GCC unroll 4
      for (int i = 0; i < B; ++i) a[c][i] += b * rv[i];
    }
  }
}

// dst_j += sum_{h < Gh} x[j][h] * A[h] for the n rows dst_j = dst + rows[j] * D (A: [W, D] rows), plus the same
// of a second token's (x1, A1) when given: the small product x^T A by tiles of 4 keys x 4 vectors of d, so that
// each loaded row piece of A serves 4 keys. A tile whose keys repeat a row (a duplicated block id) goes key by
// key, so that each addition lands.
template <typename T>
void row_scatter(const typename Vec<T>::type* x, const T* A, int64_t Gh, int64_t D, T* dst, const int64_t* rows,
                 int64_t n, const typename Vec<T>::type* x1 = nullptr, const T* A1 = nullptr) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  constexpr int C = 4, B = 4;  // keys, vectors of d per tile
  const int tokens = x1 != nullptr ? 2 : 1;
  int64_t j = 0;
  for (; j + C <= n; j += C) {
    const int64_t* r = rows + j;
    if (r[0] == r[1] || r[0] == r[2] || r[0] == r[3] || r[1] == r[2] || r[1] == r[3] || r[2] == r[3]) {
      row_scatter_keys<T>(x + j, A, Gh, D, dst, r, C, x1 != nullptr ? x1 + j : nullptr, A1);
      continue;
    }
    T* o[C];
    for (int c = 0; c < C; ++c) o[c] = dst + rows[j + c] * D;
    for (int64_t i = j + C; i < std::min(n, j + 2 * C); ++i) prefetch_row(dst + rows[i] * D, D, true);
    int64_t d0 = 0;
    for (; d0 + B * W <= D; d0 += B * W) {
      V a[C][B];
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < B; ++i) a[c][i] = load<T>(o[c] + d0 + i * W);
      scatter_tile<T, C, B>(a, x + j, A + d0, Gh, D);
      if (tokens == 2) scatter_tile<T, C, B>(a, x1 + j, A1 + d0, Gh, D);
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < B; ++i) store<T>(o[c] + d0 + i * W, a[c][i]);
    }
    if (d0 < D)  // the last d, fewer than B vectors: key by key
      for (int c = 0; c < C; ++c)
        scatter_key<T>(o[c], reinterpret_cast<const T*>(x + j + c), A,
                       x1 != nullptr ? reinterpret_cast<const T*>(x1 + j + c) : nullptr, A1, Gh, D, d0);
  }
  row_scatter_keys<T>(x + j, A, Gh, D, dst, rows + j, n - j, x1 != nullptr ? x1 + j : nullptr, A1);
}

// s[c][i] = sum_d x[c][d] * src_i[d] for the NT tokens x[c] (1 or 2) and the R rows src_i = base + rows[i] * ld
// (length D): R x NT accumulators, each loaded key element broadcast once for every token.
template <typename T, int NT, int R>
inline void scores_rows(const typename Vec<T>::type* const (&x)[NT], int64_t D, const T* base, const int64_t* rows,
                        int64_t ld, typename Vec<T>::type* const (&s)[NT], int64_t j) {
  typedef typename Vec<T>::type V;
  const T* r[R];
  for (int i = 0; i < R; ++i) r[i] = base + rows[j + i] * ld;
  V a[NT][R] = {};
  for (int64_t d = 0; d < D; ++d) {
    V u[NT];
    for (int c = 0; c < NT; ++c) u[c] = x[c][d];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const T kd = r[i][d];
      for (int c = 0; c < NT; ++c) a[c][i] += u[c] * kd;
    }
  }
  for (int c = 0; c < NT; ++c)
    for (int i = 0; i < R; ++i) s[c][j + i] = a[c][i];
}

// The NT tokens' scores over the same n rows (as scores_rows), by 8 rows (the next 8 prefetched), then 4, then 1.
template <typename T, int NT>
void scores_by_rows(const typename Vec<T>::type* const (&x)[NT], int64_t D, const T* base, const int64_t* rows,
                    int64_t n, int64_t ld, typename Vec<T>::type* const (&s)[NT]) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int64_t i = j + 8; i < std::min(n, j + 16); ++i) prefetch_row(base + rows[i] * ld, D);
    scores_rows<T, NT, 8>(x, D, base, rows, ld, s, j);
  }
  if (j + 4 <= n) {
    scores_rows<T, NT, 4>(x, D, base, rows, ld, s, j);
    j += 4;
  }
  for (; j < n; ++j) scores_rows<T, NT, 1>(x, D, base, rows, ld, s, j);
}

// s[j] = sum_d xT[d] * src_j[d] for the n rows src_j = base + rows[j] * ld (length D).
template <typename T>
void row_scores(const typename Vec<T>::type* xT, int64_t D, const T* base, const int64_t* rows, int64_t n,
                int64_t ld, typename Vec<T>::type* s) {
  scores_by_rows<T, 1>({xT}, D, base, rows, n, ld, {s});
}

// Two tokens' scores over the same n rows: s0 of x0T, s1 of x1T (as row_scores); each loaded key element serves both.
template <typename T>
void row_scores2(const typename Vec<T>::type* x0, const typename Vec<T>::type* x1, int64_t D, const T* base,
                 const int64_t* rows, int64_t n, int64_t ld, typename Vec<T>::type* s0, typename Vec<T>::type* s1) {
  scores_by_rows<T, 2>({x0, x1}, D, base, rows, n, ld, {s0, s1});
}

// o[c][d] += sum_j p[c][j] * src_j[d], d < Dv, for the NT tokens c (1 or 2) over the same n rows (as in scores_rows):
// by slices of 16 / NT values of d (16 accumulators in registers), each loaded value element serving every token.
template <typename T, int NT>
void combine_rows(const typename Vec<T>::type* const (&p)[NT], const T* base, const int64_t* rows, int64_t n,
                  int64_t ld, int64_t Dv, typename Vec<T>::type* const (&o)[NT]) {
  typedef typename Vec<T>::type V;
  constexpr int B = 16 / NT;
  int64_t d0 = 0;
  for (; d0 + B <= Dv; d0 += B) {
    V a[NT][B];
    for (int c = 0; c < NT; ++c)
      for (int i = 0; i < B; ++i) a[c][i] = o[c][d0 + i];
    for (int64_t j = 0; j < n; ++j) {
      if (d0 == 0 && j + 8 < n) prefetch_row(base + rows[j + 8] * ld, Dv);  // the first pass meets each row first
      V u[NT];
      for (int c = 0; c < NT; ++c) u[c] = p[c][j];
      const T* r = base + rows[j] * ld + d0;
#pragma GCC unroll 16
      for (int i = 0; i < B; ++i) {
        const T x = r[i];
        for (int c = 0; c < NT; ++c) a[c][i] += u[c] * x;
      }
    }
    for (int c = 0; c < NT; ++c)
      for (int i = 0; i < B; ++i) o[c][d0 + i] = a[c][i];
  }
  for (; d0 < Dv; ++d0) {
    V a[NT];
    for (int c = 0; c < NT; ++c) a[c] = o[c][d0];
    for (int64_t j = 0; j < n; ++j) {
      const T x = base[rows[j] * ld + d0];
      for (int c = 0; c < NT; ++c) a[c] += p[c][j] * x;
    }
    for (int c = 0; c < NT; ++c) o[c][d0] = a[c];
  }
}

// outT[d] += sum_j p[j] * src_j[d], d < Dv (the rows as in row_scores).
template <typename T>
void row_combine(const typename Vec<T>::type* p, const T* base, const int64_t* rows, int64_t n, int64_t ld,
                 int64_t Dv, typename Vec<T>::type* outT) {
  combine_rows<T, 1>({p}, base, rows, n, ld, Dv, {outT});
}

// o0T[d] += sum_j p0[j] * src_j[d] and o1T[d] += the same of p1: two tokens' products over the same n rows.
template <typename T>
void row_combine2(const typename Vec<T>::type* p0, const typename Vec<T>::type* p1, const T* base,
                  const int64_t* rows, int64_t n, int64_t ld, int64_t Dv, typename Vec<T>::type* o0,
                  typename Vec<T>::type* o1) {
  combine_rows<T, 2>({p0, p1}, base, rows, n, ld, Dv, {o0, o1});
}

// sum_d x[d] * y[d]: W partial sums, then a tree
template <typename T> T dot(const T* x, const T* y, int64_t n) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  V acc{};
  int64_t d = 0;
  for (; d + W <= n; d += W) acc += load<T>(x + d) * load<T>(y + d);
  T r = sparseops_simd::hsum(acc);
  for (; d < n; ++d) r += x[d] * y[d];
  return r;
}

}  // namespace sparseops_attn
