// The lightning indexer on the CPU (docs/dsa.md, "The C++ CPU path"): its exact top-k (select), and its score
// backward (backward): per query token, its selected keys read in place, the head dim in the lanes of a vector;
// and the rows of its KL training loss (kl_rows, kl_rows_grad), one token's slots at a time.
//
// scores[t, i] = sum_h w[t, h] * relu(q[t, h] . k[key(t, i)]) at the slots i not -1; given g = d scores:
//   dw[t, h] += relu(q[t, h] . k_i) * g[t, i]
//   dq[t, h] += [q[t, h] . k_i > 0] * w[t, h] * g[t, i] * k_i
//   dk_i     += [q[t, h] . k_i > 0] * w[t, h] * g[t, i] * q[t, h]
// One item per token (its dq, dw rows are its own); dk goes into one buffer per task, added in task order by
// the caller: bitwise repeatable for a given thread count. Arguments arrive validated and contiguous; the
// backward's ids are select's own output (in [0, S) or -1), never a caller's, so they index k unchecked.
#include "cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

namespace {

using sparseops_simd::Tensor;
using sparseops_simd::load;
using sparseops_simd::store;
using sparseops_simd::Vec;

// keys per block of backward_token's three passes
constexpr int64_t KEY_BLOCK = 32;

// One token's slots (its ids, start row and d scores g): dq, dw of the token and its keys' dk rows, by blocks of
// keys in three passes: the heads' scores and coefficients c[i][h] = [x > 0] w[h] g[i]; dq[h] += c[i][h] k_i with
// dq in registers; dk_i += c[i][h] q[h]. DW: the vectors of d per row when fixed at compile time (the loops
// unrolled), 0 for any Di (a scalar tail). c: scratch of KEY_BLOCK * Hi values, rows: of KEY_BLOCK.
template <typename T, int DW>
void backward_token(const T* qt, const T* wt, const int64_t* it, int64_t start, const T* gt, const T* k, int64_t Hi,
                    int64_t Di, int64_t K, T* dqt, T* dwt, T* dkt, T* c, int64_t* rows) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  const int64_t nv = DW > 0 ? DW : Di / W;
  int64_t i = 0;
  while (i < K) {
    int64_t nb = 0;  // the block: the next KEY_BLOCK live slots
    T* cb = c;
    for (; i < K && nb < KEY_BLOCK; ++i)
      if (it[i] >= 0) {
        rows[nb] = start + it[i];
        cb[nb++] = gt[i];  // g for now: pass 1 turns it into the coefficients
      }
    for (int64_t i2 = i; i2 < std::min(K, i + KEY_BLOCK); ++i2)
      if (it[i2] >= 0) {
        sparseops_simd::prefetch_row(k + (start + it[i2]) * Di, Di);
        sparseops_simd::prefetch_row(dkt + (start + it[i2]) * Di, Di, true);
      }
    // pass 1: the heads' scores, four at a time (a missing fourth head repeats the last one); without a branch
    // on the sign (a coin flip per head): an inactive head adds 0 * its terms, as the torch path's products do
    for (int64_t h0 = 0; h0 < Hi; h0 += 4) {
      const T* qh[4];
      for (int u = 0; u < 4; ++u) qh[u] = qt + std::min(h0 + u, Hi - 1) * Di;
      for (int64_t j = 0; j < nb; ++j) {
        const T* kr = k + rows[j] * Di;
        V a[4] = {};
#pragma GCC unroll 8
        for (int64_t v = 0; v < nv; ++v) {
          const V kv = load<T>(kr + v * W);
          for (int u = 0; u < 4; ++u) a[u] += load<T>(qh[u] + v * W) * kv;
        }
        const T gi = c[j];
        for (int u = 0; u < 4 && h0 + u < Hi; ++u) {
          T x = sparseops_simd::hsum(a[u]);
          if (DW == 0)
            for (int64_t d = nv * W; d < Di; ++d) x += qh[u][d] * kr[d];
          const bool on = x > 0;
          dwt[h0 + u] += (on ? x : T(0)) * gi;
          c[KEY_BLOCK + j * Hi + h0 + u] = on ? wt[h0 + u] * gi : T(0);
        }
      }
    }
    const T* cf = c + KEY_BLOCK;  // [nb, Hi]
    // pass 2: dq, four heads x one vector of d in registers over the block's keys
    for (int64_t h0 = 0; h0 < Hi; h0 += 4) {
      const int64_t nh = std::min<int64_t>(4, Hi - h0);
      for (int64_t v = 0; v < nv; ++v) {
        V a[4] = {};
        for (int u = 0; u < nh; ++u) a[u] = load<T>(dqt + (h0 + u) * Di + v * W);
        for (int64_t j = 0; j < nb; ++j) {
          const V kv = load<T>(k + rows[j] * Di + v * W);
          for (int u = 0; u < 4; ++u) a[u] += cf[j * Hi + std::min<int64_t>(h0 + u, Hi - 1)] * kv;
        }
        for (int u = 0; u < nh; ++u) store<T>(dqt + (h0 + u) * Di + v * W, a[u]);
      }
      if (DW == 0)
        for (int64_t d = nv * W; d < Di; ++d)
          for (int u = 0; u < nh; ++u)
            for (int64_t j = 0; j < nb; ++j) dqt[(h0 + u) * Di + d] += cf[j * Hi + h0 + u] * k[rows[j] * Di + d];
    }
    // pass 3: each key's dk row, once (a key twice in the block is added twice, in order)
    for (int64_t j = 0; j < nb; ++j) {
      T* dkr = dkt + rows[j] * Di;
      const T* cj = cf + j * Hi;
#pragma GCC unroll 8
      for (int64_t v = 0; v < nv; ++v) {
        V acc = load<T>(dkr + v * W);
        for (int64_t h = 0; h < Hi; ++h) acc += cj[h] * load<T>(qt + h * Di + v * W);
        store<T>(dkr + v * W, acc);
      }
      if (DW == 0)
        for (int64_t d = nv * W; d < Di; ++d)
          for (int64_t h = 0; h < Hi; ++h) dkr[d] += cj[h] * qt[h * Di + d];
    }
  }
}

template <typename T>
void backward_impl(const T* q, const T* k, const T* w, const int64_t* ids, const int64_t* start, const T* g,
                   int64_t T1, int64_t Hi, int64_t Di, int64_t K, int64_t rows_k, T* dq, T* dk, T* dw, int64_t P) {
  constexpr int W = Vec<T>::W;
  const int64_t blocks = (T1 + 3) / 4;
  auto token = &backward_token<T, 0>;
  if (Di == 4 * W) token = &backward_token<T, 4>;
  if (Di == 8 * W) token = &backward_token<T, 8>;
  sparseops_simd::run_tasks(P, [&](int64_t tid) {
    T* dkt = dk + tid * rows_k * Di;
    std::vector<T> c(KEY_BLOCK * (Hi + 1));
    std::vector<int64_t> rows(KEY_BLOCK);
    for (int64_t b = tid; b < blocks; b += P)
      for (int64_t t = b * 4; t < std::min(T1, b * 4 + 4); ++t)
        token(q + t * Hi * Di, w + t * Hi, ids + t * K, start[t], g + t * K, k, Hi, Di, K, dq + t * Hi * Di,
              dw + t * Hi, dkt, c.data(), rows.data());
  });
}

// Runs fn(t) for every row t < T1: rows in blocks of 16 dealt round-robin to P tasks, one thread each.
template <typename F> void for_rows(int64_t T1, int64_t P, F fn) {
  const int64_t blocks = (T1 + 15) / 16;
  sparseops_simd::run_tasks(P, [&](int64_t tid) {
    for (int64_t b = tid; b < blocks; b += P)
      for (int64_t t = b * 16; t < std::min(T1, b * 16 + 16); ++t) fn(t);
  });
}

// The indexer loss's rows (docs/dsa.md) over each token's live slots i (ids[t, i] >= 0), scores s and target p:
//   lse[t] = log sum_i exp(s[t, i]),  kl[t] = sum_{i: p > 0} p[t, i] * (log p[t, i] - s[t, i] + lse[t]),
//   mass[t] = sum_{i: p > 0} p[t, i]  (the backward's d kl / d s[t, i] = mass * softmax_i - p[t, i])
// A row without a live slot gives 0, 0, 0. Exponents are clamped to [floor, 0] below the row's max.
template <typename T>
void kl_rows_impl(const T* s, const T* p, const int64_t* ids, int64_t T1, int64_t K, T floor, T* kl, T* lse,
                  T* mass, int64_t P) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for_rows(T1, P, [&](int64_t t) {
    const T *st = s + t * K, *pt = p + t * K;
    const int64_t* it = ids + t * K;
    T mx = ninf;
    bool any = false;
    for (int64_t i = 0; i < K; ++i)
      if (it[i] >= 0) {
        any = true;
        mx = (st[i] > mx || st[i] != st[i]) ? st[i] : mx;
      }
    if (!any) {
      kl[t] = lse[t] = mass[t] = T(0);
      return;
    }
    const T m0 = std::isinf(mx) ? T(0) : mx;
    T sum = 0;
    for (int64_t i = 0; i < K; ++i)
      if (it[i] >= 0) sum += std::exp(std::max(st[i] - m0, floor));
    const T l = m0 + std::log(sum);
    T acc = 0, ms = 0;
    for (int64_t i = 0; i < K; ++i)
      if (it[i] >= 0 && pt[i] > 0) {
        acc += pt[i] * (std::log(pt[i]) - st[i] + l);
        ms += pt[i];
      }
    kl[t] = acc;
    lse[t] = l;
    mass[t] = ms;
  });
}

// ds[t, i] = c * (mass[t] * exp(s[t, i] - lse[t]) - p[t, i]) at the live slots, 0 elsewhere (c = d loss / d kl).
template <typename T>
void kl_rows_grad_impl(const T* s, const T* p, const int64_t* ids, const T* lse, const T* mass, int64_t T1,
                       int64_t K, T c, T floor, T* ds, int64_t P) {
  for_rows(T1, P, [&](int64_t t) {
    const T *st = s + t * K, *pt = p + t * K;
    const int64_t* it = ids + t * K;
    T* dt = ds + t * K;
    for (int64_t i = 0; i < K; ++i) {
      const T pi = pt[i] > 0 ? pt[i] : T(0);
      dt[i] = it[i] >= 0 ? c * (mass[t] * std::exp(std::max(st[i] - lse[t], floor)) - pi) : T(0);
    }
  });
}

// Keys that order like the scores (their bits, sign-flipped), and a (key, position) record whose ascending order
// is: score descending, then position ascending (fp32: packed in one 64-bit word).
template <typename T> struct Keys;
template <> struct Keys<float> {
  typedef uint32_t K;
  typedef uint64_t Pick;
  static K key(float x) {
    x += 0.0f;  // -0 and +0 are one score (a tie), so one key
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  static Pick pick(K k, int64_t pos) { return (uint64_t(K(~k)) << 32) | uint64_t(pos); }
  static int64_t pos(Pick p) { return int64_t(p & 0xffffffffu); }
};
template <> struct Keys<double> {
  typedef uint64_t K;
  typedef std::pair<uint64_t, int64_t> Pick;
  static K key(double x) {
    x += 0.0;
    uint64_t u;
    std::memcpy(&u, &x, 8);
    return (u >> 63) ? ~u : (u | (uint64_t(1) << 63));
  }
  static Pick pick(K k, int64_t pos) { return {~k, pos}; }
  static int64_t pos(const Pick& p) { return p.second; }
};

// The kk-th largest of n keys, exactly: a radix select, 11 bits per counting pass from the top.
template <typename K> K kth_largest(const K* key, int64_t n, int64_t kk, std::vector<uint32_t>& hist) {
  constexpr int bits = 8 * sizeof(K);
  K prefix = 0, mask = 0;
  for (int hi = bits; hi > 0; hi -= 11) {
    const int width = std::min(11, hi), sh = hi - width;
    const K buckets = K(1) << width;
    std::fill(hist.begin(), hist.begin() + buckets, 0u);
    for (int64_t i = 0; i < n; ++i)
      if ((key[i] & mask) == prefix) ++hist[(key[i] >> sh) & (buckets - 1)];
    K b = buckets;
    while (b-- > 0) {  // from the top bucket down to the one holding the kk-th
      if (int64_t(hist[b]) >= kk) break;
      kk -= hist[b];
    }
    prefix |= b << sh;
    mask |= (buckets - 1) << sh;
  }
  return prefix;
}

// out[r][s] = sum_h w_r[h] * relu(q_r[h] . k[s]) for the R query rows r of one sequence and its first nk keys
// (kT + start: the sequence's keys transposed, [Di, ld]); the keys in vector lanes, 2 vectors x 4 heads x R
// queries of accumulators, so that each load of the keys serves 4 R FMAs. Writes up to 2 W - 1 past nk.
template <typename T, int R>
void index_scores(const T* const* qs, const T* const* ws, const T* base, int64_t ld, int64_t Hi, int64_t Di,
                  int64_t nk, T* const* out) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  for (int64_t s0 = 0; s0 < nk; s0 += 2 * W) {
    V acc[R][2] = {};
    int64_t h = 0;
    for (; h + 4 <= Hi; h += 4) {
      V a[R][4][2] = {};
      for (int64_t d = 0; d < Di; ++d) {
        const V k0 = load<T>(base + d * ld + s0), k1 = load<T>(base + d * ld + s0 + W);
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            const T x = qs[r][(h + c) * Di + d];
            a[r][c][0] += x * k0;
            a[r][c][1] += x * k1;
          }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) {
          acc[r][0] += ws[r][h + c] * (a[r][c][0] > 0 ? a[r][c][0] : V{});
          acc[r][1] += ws[r][h + c] * (a[r][c][1] > 0 ? a[r][c][1] : V{});
        }
    }
    for (; h < Hi; ++h)
      for (int r = 0; r < R; ++r) {
        V a0{}, a1{};
        for (int64_t d = 0; d < Di; ++d) {
          const T x = qs[r][h * Di + d];
          a0 += x * load<T>(base + d * ld + s0);
          a1 += x * load<T>(base + d * ld + s0 + W);
        }
        acc[r][0] += ws[r][h] * (a0 > 0 ? a0 : V{});
        acc[r][1] += ws[r][h] * (a1 > 0 ? a1 : V{});
      }
    for (int r = 0; r < R; ++r) {
      store<T>(out[r] + s0, acc[r][0]);
      store<T>(out[r] + s0 + W, acc[r][1]);
    }
  }
}

// The exact top-k of each query row: I[s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the row's visible keys (the
// sequence's first nk), keys in the lanes of a vector (kT: the keys transposed, [Di, ld] with at least W columns
// of padding); the kk = min(topk, nk) largest, ties to the smaller position, in descending score with equal
// scores in position order (NaN counts as -inf).
template <typename T>
void select_impl(const T* q, const T* kT, int64_t ld, const T* w, const int64_t* start, const int64_t* nvis,
                 int64_t T1, int64_t Hi, int64_t Di, int64_t topk, int32_t* out_idx, T* out_sc, int64_t P) {
  constexpr int W = Vec<T>::W;
  const int64_t blocks = (T1 + 3) / 4;
  const T ninf = -std::numeric_limits<T>::infinity();
  int64_t most = 0;
  for (int64_t t = 0; t < T1; ++t) most = std::max(most, nvis[t]);
  sparseops_simd::run_tasks(P, [&](int64_t tid) {
    typedef Keys<T> KT;
    std::vector<T> rows(4 * (most + 2 * W));
    std::vector<typename KT::K> key(most);
    std::vector<uint32_t> hist(2048);
    std::vector<typename KT::Pick> pick(topk);
    for (int64_t b = tid; b < blocks; b += P) {
      const int64_t t0 = b * 4, t1 = std::min(T1, b * 4 + 4);
      // the block's score rows, two queries of one sequence at a time (they share each load of the keys)
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t u = std::min(t + 1, t1 - 1);  // the pair's second row (t itself when there is none)
        const T* qs[2] = {q + t * Hi * Di, q + u * Hi * Di};
        const T* ws[2] = {w + t * Hi, w + u * Hi};
        T* out[2] = {rows.data() + (t - t0) * (most + 2 * W), rows.data() + (u - t0) * (most + 2 * W)};
        if (u > t && start[u] == start[t]) {
          index_scores<T, 2>(qs, ws, kT + start[t], ld, Hi, Di, std::max(nvis[t], nvis[t + 1]), out);
          ++t;
        } else {
          index_scores<T, 1>(qs, ws, kT + start[t], ld, Hi, Di, nvis[t], out);
        }
      }
      auto scores_of = [&](int64_t t) { return rows.data() + (t - t0) * (most + 2 * W); };
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t nk = nvis[t], kk = std::min(topk, nk);
        if (nk == 0) continue;
        T* sc = scores_of(t);
        for (int64_t s = 0; s < nk; ++s)
          if (sc[s] != sc[s]) sc[s] = ninf;
        // the row's kk largest as sortable keys: value descending, then position ascending
        int64_t n = 0;
        if (nk <= kk) {
          for (int64_t s = 0; s < nk; ++s) pick[n++] = KT::pick(KT::key(sc[s]), s);
        } else {
          for (int64_t s = 0; s < nk; ++s) key[s] = KT::key(sc[s]);
          const typename KT::K v = kth_largest(key.data(), nk, kk, hist);
          int64_t above = 0;
          for (int64_t s = 0; s < nk; ++s) above += key[s] > v;
          int64_t ties = kk - above;
          for (int64_t s = 0; s < nk && n < kk; ++s)
            if (key[s] > v || (key[s] == v && ties-- > 0)) pick[n++] = KT::pick(key[s], s);
        }
        std::sort(pick.begin(), pick.begin() + n);
        int32_t* oi = out_idx + t * topk;
        T* os = out_sc + t * topk;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pos = KT::pos(pick[i]);
          os[i] = sc[pos];
          oi[i] = sc[pos] == ninf ? -1 : static_cast<int32_t>(pos);
        }
      }
    }
  });
}

void topk_select(Tensor q, Tensor kT, Tensor w, Tensor start, Tensor nvis, Tensor out_idx, Tensor out_sc,
                 int64_t tasks) {
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    select_impl<T>(q.data_ptr<T>(), kT.data_ptr<T>(), kT.size(1), w.data_ptr<T>(), start.data_ptr<int64_t>(),
                   nvis.data_ptr<int64_t>(), q.size(0), q.size(1), q.size(2), out_idx.size(1),
                   out_idx.data_ptr<int32_t>(), out_sc.data_ptr<T>(), tasks);
  });
}

void backward(Tensor q, Tensor k, Tensor w, Tensor ids, Tensor start, Tensor g, Tensor dq, Tensor dk, Tensor dw,
              int64_t tasks) {
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    backward_impl<T>(q.data_ptr<T>(), k.data_ptr<T>(), w.data_ptr<T>(), ids.data_ptr<int64_t>(),
                     start.data_ptr<int64_t>(), g.data_ptr<T>(), q.size(0), q.size(1), q.size(2), ids.size(1),
                     k.size(0), dq.data_ptr<T>(), dk.data_ptr<T>(), dw.data_ptr<T>(), tasks);
  });
}

void kl_rows(Tensor s, Tensor p, Tensor ids, double floor, Tensor kl, Tensor lse, Tensor mass, int64_t tasks) {
  sparseops_simd::by_dtype(s, [&](auto z) {
    using T = decltype(z);
    kl_rows_impl<T>(s.data_ptr<T>(), p.data_ptr<T>(), ids.data_ptr<int64_t>(), s.size(0), s.size(1), T(floor),
                    kl.data_ptr<T>(), lse.data_ptr<T>(), mass.data_ptr<T>(), tasks);
  });
}

void kl_rows_grad(Tensor s, Tensor p, Tensor ids, Tensor lse, Tensor mass, double c, double floor, Tensor ds,
                  int64_t tasks) {
  sparseops_simd::by_dtype(s, [&](auto z) {
    using T = decltype(z);
    kl_rows_grad_impl<T>(s.data_ptr<T>(), p.data_ptr<T>(), ids.data_ptr<int64_t>(), lse.data_ptr<T>(),
                         mass.data_ptr<T>(), s.size(0), s.size(1), T(c), T(floor), ds.data_ptr<T>(), tasks);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("select", &topk_select, "DSA indexer exact top-k (CPU, keys in vector lanes)");
  mod.def("backward", &backward, "DSA indexer score backward (CPU, selected keys per token)");
  mod.def("kl_rows", &kl_rows, "DSA indexer loss rows: KL, log-sum-exp and target mass per token (CPU)");
  mod.def("kl_rows_grad", &kl_rows_grad, "DSA indexer loss rows' gradient in the scores (CPU)");
}
