// NSA selected attention on the CPU, one (query token, KV head) at a time with its gathered keys in the cache
// and its heads in the lanes of one vector register (docs/nsa.md, "The C++ CPU path"; docs/perf.md).
//
// Range mode (forward_ranges / backward_ranges: the NSA module's sliding-window and compressed branches): token t
// sees the contiguous key rows [lo[t], hi[t]) of each KV head, no other rule.
//
// Arguments arrive validated and contiguous from sparseops/_cpu_attention.py and sparseops/nsa/cpu_gather.py:
//   q [T1, N1, D] (the softmax scale applied as it is loaded), k [T2, N2, D], v [T2, N2, Dv] (fp32 or float64),
//   topk [T1, N2, K] int64 block ids (-1 = none), and per query token its sequence's first key row, key count
//   and its own in-sequence position. A gathered key p = idx * bs + r is visible iff idx != -1, p < S2 and, when
//   causal, p <= pos: the rule of the reference (sparseops/nsa/reference.py).
//
// Layout of the work: the G query heads of a KV head fill the W lanes of a 64-byte vector (16 fp32 / 8 float64;
// more heads take several items, fewer leave lanes at 0). Each product then runs as broadcast-FMAs:
//   scores  s[j]   = sum_d qT[d] * k_j[d]          (qT [D] vectors: q transposed)
//   outputs oT[d]  = sum_j p[j] * v_j[d]           (16 accumulators over d in registers)
//   key rows dk_j  += sum_h ds[j][h] * q_h         (d in the lanes, for dK and dV)
// dK / dV go into one private buffer per task; the Python side adds the buffers in task order, and each task's
// items are fixed by the item index alone: the backward is bitwise repeatable for a given thread count.
#include "cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using sparseops_simd::Tensor;
using sparseops_simd::load;
using sparseops_simd::prefetch_row;
using sparseops_simd::store;
using sparseops_simd::Vec;
using sparseops_simd::vexp;

// keys per block of the backward's fused products
constexpr int64_t KEY_BLOCK = 64;

template <typename T> struct Args {
  const T *q, *k, *v;
  const int64_t *topk, *kv_start, *seq_len, *pos;
  const int64_t *lo = nullptr, *hi = nullptr;  // range mode (topk null): token t sees key rows [lo[t], hi[t])
  int64_t T1, N1, N2, D, Dv, K, bs, G, HB;
  bool causal;
  T floor;  // the lowest exponent computed (sparseops._numerics.exp_floor)
  T qscale;  // the softmax scale, applied to q as it is loaded
};

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
  const int64_t base = a.kv_start[t];
  int64_t n = 0;
  for (int64_t i = 0; i < a.K; ++i) {
    const int64_t idx = ids[i];
    if (idx < 0) continue;
    const int64_t p0 = idx * a.bs, p1 = std::min(p0 + a.bs, lim);
    for (int64_t p = p0; p < p1; ++p) {
      if (slots != nullptr) slots[n] = i;
      rows[n++] = (base + p) * a.N2 + n2;
    }
  }
  return n;
}

// s[j] = sum_d xT[d] * src_j[d] for the n rows src_j = base + rows[j] * ld (length D).
template <typename T>
void row_scores(const typename Vec<T>::type* xT, int64_t D, const T* base, const int64_t* rows, int64_t n,
                int64_t ld, typename Vec<T>::type* s) {
  typedef typename Vec<T>::type V;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const T* r[8];
    for (int i = 0; i < 8; ++i) r[i] = base + rows[j + i] * ld;
    for (int64_t i = j + 8; i < std::min(n, j + 16); ++i) prefetch_row(base + rows[i] * ld, D);
    V a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{};
    for (int64_t d = 0; d < D; ++d) {
      const V x = xT[d];
      a0 += x * r[0][d];
      a1 += x * r[1][d];
      a2 += x * r[2][d];
      a3 += x * r[3][d];
      a4 += x * r[4][d];
      a5 += x * r[5][d];
      a6 += x * r[6][d];
      a7 += x * r[7][d];
    }
    s[j] = a0; s[j + 1] = a1; s[j + 2] = a2; s[j + 3] = a3;
    s[j + 4] = a4; s[j + 5] = a5; s[j + 6] = a6; s[j + 7] = a7;
  }
  for (; j < n; ++j) {
    const T* r = base + rows[j] * ld;
    V a{};
    for (int64_t d = 0; d < D; ++d) a += xT[d] * r[d];
    s[j] = a;
  }
}

// outT[d] (+)= sum_j p[j] * src_j[d], d < Dv (the rows as in row_scores; add when `add`, else overwrite).
template <typename T>
void row_combine(const typename Vec<T>::type* p, const T* base, const int64_t* rows, int64_t n, int64_t ld,
                 int64_t Dv, typename Vec<T>::type* outT, bool add) {
  typedef typename Vec<T>::type V;
  constexpr int B = 16;
  int64_t d0 = 0;
  for (; d0 + B <= Dv; d0 += B) {
    V a[B] = {};
    if (add)
      for (int i = 0; i < B; ++i) a[i] = outT[d0 + i];
    for (int64_t j = 0; j < n; ++j) {
      if (d0 == 0 && j + 8 < n) prefetch_row(base + rows[j + 8] * ld, Dv);  // the first pass meets each row first
      const V pj = p[j];
      const T* r = base + rows[j] * ld + d0;
#pragma GCC unroll 16
      for (int i = 0; i < B; ++i) a[i] += pj * r[i];
    }
    for (int i = 0; i < B; ++i) outT[d0 + i] = a[i];
  }
  for (; d0 < Dv; ++d0) {
    V a = add ? outT[d0] : V{};
    for (int64_t j = 0; j < n; ++j) a += p[j] * base[rows[j] * ld + d0];
    outT[d0] = a;
  }
}

// row_scatter one key at a time.
template <typename T>
void row_scatter_keys(const typename Vec<T>::type* x, const T* A, int64_t Gh, int64_t D, T* dst,
                      const int64_t* rows, int64_t n) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  for (int64_t j = 0; j < n; ++j) {
    T* o = dst + rows[j] * D;
    const T* xs = reinterpret_cast<const T*>(x + j);
    int64_t d0 = 0;
    for (; d0 + W <= D; d0 += W) {
      V a = load<T>(o + d0);
      for (int64_t h = 0; h < Gh; ++h) a += xs[h] * load<T>(A + h * D + d0);
      store<T>(o + d0, a);
    }
    for (; d0 < D; ++d0) {
      T a = o[d0];
      for (int64_t h = 0; h < Gh; ++h) a += xs[h] * A[h * D + d0];
      o[d0] = a;
    }
  }
}

// dst_j += sum_{h < Gh} x[j][h] * A[h] for the n rows dst_j = dst + rows[j] * D (A: [W, D] rows): the small
// product x^T A by tiles of 4 keys x 4 vectors of d, so that each loaded row piece of A serves 4 keys.
// A tile whose keys repeat a row (a duplicated block id) goes key by key, so that each addition lands.
template <typename T>
void row_scatter(const typename Vec<T>::type* x, const T* A, int64_t Gh, int64_t D, T* dst, const int64_t* rows,
                 int64_t n) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  constexpr int C = 4, B = 4;  // keys, vectors of d per tile
  int64_t j = 0;
  for (; j + C <= n; j += C) {
    const int64_t* r = rows + j;
    if (r[0] == r[1] || r[0] == r[2] || r[0] == r[3] || r[1] == r[2] || r[1] == r[3] || r[2] == r[3]) {
      row_scatter_keys<T>(x + j, A, Gh, D, dst, r, C);
      continue;
    }
    T* o[C];
    const T* xs[C];
    for (int c = 0; c < C; ++c) {
      o[c] = dst + rows[j + c] * D;
      xs[c] = reinterpret_cast<const T*>(x + j + c);
    }
    for (int64_t i = j + C; i < std::min(n, j + 2 * C); ++i) prefetch_row(dst + rows[i] * D, D, true);
    int64_t d0 = 0;
    for (; d0 + B * W <= D; d0 += B * W) {
      V a[C][B];
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < B; ++i) a[c][i] = load<T>(o[c] + d0 + i * W);
      for (int64_t h = 0; h < Gh; ++h) {
        const T* ah = A + h * D + d0;
        V r[B];
        for (int i = 0; i < B; ++i) r[i] = load<T>(ah + i * W);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const T b = xs[c][h];  // a scalar: broadcast from memory (V{} + b adds in a register first)
#pragma GCC unroll 4
          for (int i = 0; i < B; ++i) a[c][i] += b * r[i];
        }
      }
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < B; ++i) store<T>(o[c] + d0 + i * W, a[c][i]);
    }
    for (; d0 + W <= D; d0 += W)
      for (int c = 0; c < C; ++c) {
        V a = load<T>(o[c] + d0);
        for (int64_t h = 0; h < Gh; ++h) a += xs[c][h] * load<T>(A + h * D + d0);
        store<T>(o[c] + d0, a);
      }
    for (; d0 < D; ++d0)
      for (int c = 0; c < C; ++c) {
        T a = o[c][d0];
        for (int64_t h = 0; h < Gh; ++h) a += xs[c][h] * A[h * D + d0];
        o[c][d0] = a;
      }
  }
  row_scatter_keys<T>(x + j, A, Gh, D, dst, rows + j, n - j);
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
  for (int64_t d = 0; d < D; ++d) xT[d] = typename Vec<T>::type{};
  for (int64_t l = 0; l < h.Gh; ++l)
    for (int64_t d = 0; d < D; ++d) xT[d][l] = base[l * D + d] * mul;
  if (N != nullptr) {
    std::fill(N, N + Vec<T>::W * D, T(0));
    for (int64_t i = 0; i < h.Gh * D; ++i) N[i] = base[i] * mul;
  }
}

template <typename T> struct Scratch {
  typedef typename Vec<T>::type V;
  std::vector<int64_t> rows, slots;
  std::vector<V> s, dp, xT, yT, oT;
  std::vector<T> qN, yN;
  Scratch(int64_t KB, int64_t D, int64_t Dv)
      : rows(KB), slots(KB), s(KB), dp(KB), xT(D), yT(Dv), oT(std::max(D, Dv)), qN(Vec<T>::W * D),
        yN(Vec<T>::W * Dv) {}
};

// Runs fn(item, task, scratch) for every item: items in blocks of 4 dealt round-robin to P tasks, one thread each.
template <typename T, typename F> void for_items(const Args<T>& a, int64_t P, F fn) {
  const int64_t items = a.T1 * a.N2 * a.HB, blocks = (items + 3) / 4;
  sparseops_simd::run_tasks(P, [&](int64_t tid) {
    Scratch<T> sc(a.K * a.bs, a.D, a.Dv);
    for (int64_t b = tid; b < blocks; b += P)
      for (int64_t it = b * 4; it < std::min(items, b * 4 + 4); ++it) fn(it, tid, sc);
  });
}

// tgt (token granularity, or null): each item's share of the DSA loss's target, [T1, N2 * HB, K] with
// tgt[t, item, slot] = (1 / N1) sum over the item's heads of its softmax at the slot's key (0 where none).
template <typename T>
void forward_impl(const Args<T>& a, T* out, T* m, T* l, T* tgt, int64_t P) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  for_items(a, P, [&](int64_t it, int64_t, Scratch<T>& sc) {
    const int64_t hb = it % a.HB, n2 = (it / a.HB) % a.N2, t = it / (a.HB * a.N2);
    const Heads<T> h(a.G, n2, hb);
    const int64_t n = visible_rows(a, t, n2, sc.rows.data(), tgt != nullptr ? sc.slots.data() : nullptr);
    T* o = out + (t * a.N1 + h.h0) * a.Dv;
    if (n == 0) {  // no visible key: out, m, l stay 0
      return;
    }
    load_heads(a.q, t, a.N1, a.D, h, sc.xT.data(), static_cast<T*>(nullptr), a.qscale);
    V* s = sc.s.data();
    row_scores<T>(sc.xT.data(), a.D, a.k, sc.rows.data(), n, a.D, s);
    V mx;
    const V sum = softmax_terms<T>(s, n, a.floor, mx);
    // by blocks of keys, so that a block's value rows and probabilities stay in the cache for every slice of d
    for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK)
      row_combine<T>(s + j0, a.v, sc.rows.data() + j0, std::min(KEY_BLOCK, n - j0), a.Dv, a.Dv, sc.oT.data(), j0 > 0);
    V inv;
    for (int i = 0; i < W; ++i) inv[i] = sum[i] > 0 ? T(1) / sum[i] : T(0);
    if (tgt != nullptr) {  // the item's heads' probabilities at each slot, summed: its share of the target
      V w{};
      for (int64_t lane = 0; lane < h.Gh; ++lane) w[lane] = inv[lane] / T(a.N1);
      T* row = tgt + it * a.K;
      for (int64_t j = 0; j < n; ++j) row[sc.slots[j]] += sparseops_simd::hsum(s[j] * w);
    }
    for (int64_t lane = 0; lane < h.Gh; ++lane) {
      for (int64_t d = 0; d < a.Dv; ++d) o[lane * a.Dv + d] = sc.oT[d][lane] * inv[lane];
      m[t * a.N1 + h.h0 + lane] = mx[lane];
      l[t * a.N1 + h.h0 + lane] = sum[lane];
    }
  });
}

template <typename T>
void backward_impl(const Args<T>& a, const T* dout, const T* lse, const T* out, T scale, T* dq, T* dk, T* dv,
                   int64_t rows_kv, int64_t P) {
  typedef typename Vec<T>::type V;
  for_items(a, P, [&](int64_t it, int64_t tid, Scratch<T>& sc) {
    const int64_t hb = it % a.HB, n2 = (it / a.HB) % a.N2, t = it / (a.HB * a.N2);
    const Heads<T> h(a.G, n2, hb);
    const int64_t n = visible_rows(a, t, n2, sc.rows.data());
    if (n == 0) return;  // dq rows stay 0
    const int64_t* rows = sc.rows.data();
    load_heads(a.q, t, a.N1, a.D, h, sc.xT.data(), sc.qN.data(), a.qscale);
    load_heads(dout, t, a.N1, a.Dv, h, sc.yT.data(), sc.yN.data(), T(1));
    V ls{}, dl{};  // dl: delta = rowsum(dO * O) of each head, from the dO rows just loaded
    const T* ob = out + (t * a.N1 + h.h0) * a.Dv;
    for (int64_t lane = 0; lane < h.Gh; ++lane) {
      ls[lane] = lse[t * a.N1 + h.h0 + lane];
      dl[lane] = dot<T>(sc.yN.data() + lane * a.Dv, ob + lane * a.Dv, a.Dv);
    }
    V *p = sc.s.data(), *ds = sc.dp.data();
    T *dkt = dk + tid * rows_kv * a.D, *dvt = dv + tid * rows_kv * a.Dv;
    // by blocks of keys, so that each block's key and value rows are read from memory once for all five products
    for (int64_t j0 = 0; j0 < n; j0 += KEY_BLOCK) {
      const int64_t nb = std::min(KEY_BLOCK, n - j0);
      const int64_t* rb = rows + j0;
      row_scores<T>(sc.xT.data(), a.D, a.k, rb, nb, a.D, p);
      for (int64_t j = 0; j < nb; ++j) p[j] = exp_clamped<T>(p[j] - ls, a.floor);
      row_scores<T>(sc.yT.data(), a.Dv, a.v, rb, nb, a.Dv, ds);
      for (int64_t j = 0; j < nb; ++j) ds[j] = (ds[j] - dl) * p[j];
      row_combine<T>(ds, a.k, rb, nb, a.D, a.D, sc.oT.data(), j0 > 0);
      row_scatter<T>(ds, sc.qN.data(), h.Gh, a.D, dkt, rb, nb);
      row_scatter<T>(p, sc.yN.data(), h.Gh, a.Dv, dvt, rb, nb);
    }
    T* g = dq + (t * a.N1 + h.h0) * a.D;
    for (int64_t lane = 0; lane < h.Gh; ++lane)
      for (int64_t d = 0; d < a.D; ++d) g[lane * a.D + d] = sc.oT[d][lane] * scale;
  });
}

// p[t, i] = (1 / N1) sum_h softmax_i(s[t, h, :]) over the slots i of indices[t] that are not -1 (0 at -1): the
// attention's head-averaged distribution over a token's selected keys, the DSA indexer loss's target. One item
// per token (all its KV heads), so each row of p is written by one task.
template <typename T>
void head_mean_impl(const T* q, const T* k, const int64_t* ids, const int64_t* start, int64_t T1, int64_t N1,
                    int64_t N2, int64_t D, int64_t K, T floor, T qscale, T* p, int64_t P) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  const int64_t G = N1 / N2, HB = (G + W - 1) / W, blocks = (T1 + 3) / 4;
  sparseops_simd::run_tasks(P, [&](int64_t tid) {
    std::vector<int64_t> key(K), rows(K), slot(K);
    std::vector<V> s(K), xT(D);
    for (int64_t b = tid; b < blocks; b += P)
      for (int64_t t = b * 4; t < std::min(T1, b * 4 + 4); ++t) {
        int64_t n = 0;
        for (int64_t i = 0; i < K; ++i)
          if (ids[t * K + i] >= 0) {
            key[n] = start[t] + ids[t * K + i];
            slot[n++] = i;
          }
        T* pt = p + t * K;
        for (int64_t n2 = 0; n2 < N2 && n > 0; ++n2) {
          for (int64_t j = 0; j < n; ++j) rows[j] = key[j] * N2 + n2;
          for (int64_t hb = 0; hb < HB; ++hb) {
            const Heads<T> h(G, n2, hb);
            load_heads(q, t, N1, D, h, xT.data(), static_cast<T*>(nullptr), qscale);
            row_scores<T>(xT.data(), D, k, rows.data(), n, D, s.data());
            V mx;
            const V sum = softmax_terms<T>(s.data(), n, floor, mx);
            V inv{};
            for (int64_t lane = 0; lane < h.Gh; ++lane) inv[lane] = sum[lane] > 0 ? T(1) / (sum[lane] * N1) : T(0);
            for (int64_t j = 0; j < n; ++j) {
              const V x = s[j] * inv;
              T acc = 0;
              for (int64_t lane = 0; lane < h.Gh; ++lane) acc += x[lane];
              pt[slot[j]] += acc;
            }
          }
        }
      }
  });
}

void head_mean_probs(Tensor q, Tensor k, Tensor ids, Tensor start, double floor, double scale,
                     Tensor p, int64_t tasks) {
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    head_mean_impl<T>(q.data_ptr<T>(), k.data_ptr<T>(), ids.data_ptr<int64_t>(), start.data_ptr<int64_t>(), q.size(0),
                      q.size(1), k.size(1), q.size(2), ids.size(1), T(floor), T(scale), p.data_ptr<T>(), tasks);
  });
}

// The fields every mode shares: tensors, sizes, K keys (or slots) per item, block size, the rule's flags.
template <typename T>
Args<T> base_args(const Tensor& q, const Tensor& k, const Tensor& v, int64_t K, int64_t bs, bool causal,
                  double floor, double scale) {
  Args<T> a;
  a.q = q.data_ptr<T>();
  a.k = k.data_ptr<T>();
  a.v = v.data_ptr<T>();
  a.topk = a.kv_start = a.seq_len = a.pos = nullptr;
  a.T1 = q.size(0);
  a.N1 = q.size(1);
  a.D = q.size(2);
  a.N2 = k.size(1);
  a.Dv = v.size(2);
  a.K = K;
  a.bs = bs;
  a.G = a.N1 / a.N2;
  a.HB = (a.G + Vec<T>::W - 1) / Vec<T>::W;
  a.causal = causal;
  a.floor = static_cast<T>(floor);
  a.qscale = static_cast<T>(scale);
  return a;
}

template <typename T>
Args<T> make_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& topk,
                  const Tensor& kv_start, const Tensor& seq_len, const Tensor& pos, int64_t bs,
                  bool causal, double floor, double scale) {
  Args<T> a = base_args<T>(q, k, v, topk.size(2), bs, causal, floor, scale);
  a.topk = topk.data_ptr<int64_t>();
  a.kv_start = kv_start.data_ptr<int64_t>();
  a.seq_len = seq_len.data_ptr<int64_t>();
  a.pos = pos.data_ptr<int64_t>();
  return a;
}

// tgt: a [T1, N2 * HB, K] zero tensor for the DSA loss's target (token granularity), or None
void forward(Tensor q, Tensor k, Tensor v, Tensor topk, Tensor kv_start,
             Tensor seq_len, Tensor pos, int64_t bs, bool causal, double floor, double scale, Tensor out,
             Tensor m, Tensor l, pybind11::object tgt, int64_t tasks) {
  const bool want = !tgt.is_none();
  const Tensor tg = want ? Tensor(tgt) : Tensor();
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    forward_impl(make_args<T>(q, k, v, topk, kv_start, seq_len, pos, bs, causal, floor, scale), out.data_ptr<T>(),
                 m.data_ptr<T>(), l.data_ptr<T>(), want ? tg.data_ptr<T>() : nullptr, tasks);
  });
}

void backward(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor lse,
              Tensor out, Tensor topk, Tensor kv_start, Tensor seq_len,
              Tensor pos, int64_t bs, bool causal, double floor, double scale, Tensor dq,
              Tensor dk, Tensor dv, int64_t tasks) {
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    backward_impl(make_args<T>(q, k, v, topk, kv_start, seq_len, pos, bs, causal, floor, scale), dout.data_ptr<T>(),
                  lse.data_ptr<T>(), out.data_ptr<T>(), T(scale), dq.data_ptr<T>(), dk.data_ptr<T>(),
                  dv.data_ptr<T>(), k.size(0) * k.size(1), tasks);
  });
}

// Range mode (the NSA module's sliding-window and compressed branches): token t sees the contiguous key rows
// [lo[t], hi[t]) of every KV head, no other rule; K is the longest range.
template <typename T>
Args<T> range_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lo, const Tensor& hi, int64_t K,
                   double floor, double scale) {
  Args<T> a = base_args<T>(q, k, v, K, 1, false, floor, scale);
  a.lo = lo.data_ptr<int64_t>();
  a.hi = hi.data_ptr<int64_t>();
  return a;
}

void forward_ranges(Tensor q, Tensor k, Tensor v, Tensor lo, Tensor hi, int64_t K, double floor, double scale,
                    Tensor out, Tensor m, Tensor l, int64_t tasks) {
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    forward_impl(range_args<T>(q, k, v, lo, hi, K, floor, scale), out.data_ptr<T>(), m.data_ptr<T>(),
                 l.data_ptr<T>(), static_cast<T*>(nullptr), tasks);
  });
}

void backward_ranges(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor lse, Tensor out, Tensor lo, Tensor hi,
                     int64_t K, double floor, double scale, Tensor dq, Tensor dk, Tensor dv, int64_t tasks) {
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    backward_impl(range_args<T>(q, k, v, lo, hi, K, floor, scale), dout.data_ptr<T>(), lse.data_ptr<T>(),
                  out.data_ptr<T>(), T(scale), dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>(),
                  k.size(0) * k.size(1), tasks);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("forward", &forward, "NSA selected attention forward (CPU, gathered keys per token)");
  mod.def("backward", &backward, "NSA selected attention backward (CPU, gathered keys per token)");
  mod.def("forward_ranges", &forward_ranges, "attention over a contiguous key range per token (CPU)");
  mod.def("backward_ranges", &backward_ranges, "its backward (CPU)");
  mod.def("head_mean_probs", &head_mean_probs, "head-averaged softmax over each token's selected keys (CPU)");
}
