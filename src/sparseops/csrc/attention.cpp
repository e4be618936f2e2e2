// NSA selected attention on the CPU with each query token's keys read in place and its heads in the lanes of one
// vector register (docs/nsa.md, "The C++ CPU path"; docs/perf.md); the products are in attention_products.h.
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
// more heads take several items, fewer leave lanes at 0). Two ways through the keys:
// - tiles (attention_tiles.h; blocks of 16 keys and more, and range mode): an item is a tile of consecutive query
//   tokens, whose visits of the same key rows run in pairs;
// - tokens (here; token granularity, and the DSA loss's target): an item is one token, its keys in slot order.
// dK / dV go into one private buffer per task; the Python side adds the buffers in task order, and each task's
// items are fixed by the item index alone: the backward is bitwise repeatable for a given thread count.
#include "attention_items.h"
#include "attention_products.h"
#include "attention_tiles.h"
#include "cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace sparseops_attn;
using sparseops_simd::Tensor;

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
void forward_tokens(const Args<T>& a, T* out, T* m, T* l, T* tgt, int64_t P) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  for_items(a, P, [&](int64_t it, int64_t, Scratch<T>& sc) {
    const int64_t hb = it % a.HB, n2 = (it / a.HB) % a.N2, t = it / (a.HB * a.N2);
    const Heads<T> h(a.G, n2, hb);
    const int64_t n = visible_rows(a, t, n2, sc.rows.data(), tgt != nullptr ? sc.slots.data() : nullptr);
    T* o = out + (t * a.N1 + h.h0) * a.Dv;
    if (n == 0) {  // no visible key: out, m, l are 0
      std::fill(o, o + h.Gh * a.Dv, T(0));
      std::fill(m + t * a.N1 + h.h0, m + t * a.N1 + h.h0 + h.Gh, T(0));
      std::fill(l + t * a.N1 + h.h0, l + t * a.N1 + h.h0 + h.Gh, T(0));
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
void backward_tokens(const Args<T>& a, const T* dout, const T* lse, const T* out, T scale, T* dq, T* dk, T* dv,
                     int64_t rows_kv, int64_t P) {
  typedef typename Vec<T>::type V;
  for_items(a, P, [&](int64_t it, int64_t tid, Scratch<T>& sc) {
    const int64_t hb = it % a.HB, n2 = (it / a.HB) % a.N2, t = it / (a.HB * a.N2);
    const Heads<T> h(a.G, n2, hb);
    const int64_t n = visible_rows(a, t, n2, sc.rows.data());
    if (n == 0) {  // dq rows are 0
      T* g = dq + (t * a.N1 + h.h0) * a.D;
      std::fill(g, g + h.Gh * a.D, T(0));
      return;
    }
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

// The tiles where blocks of 16 keys and more or ranges make visits worth pairing; tokens at token granularity
// and for the DSA loss's target (tgt: per-slot output).
template <typename T> bool use_tiles(const Args<T>& a, const T* tgt) {
  return tgt == nullptr && (a.topk == nullptr || a.bs >= 16);
}

template <typename T> void forward_impl(const Args<T>& a, T* out, T* m, T* l, T* tgt, int64_t P) {
  if (use_tiles(a, tgt))
    forward_tiles(a, out, m, l, P);
  else
    forward_tokens(a, out, m, l, tgt, P);
}

template <typename T>
void backward_impl(const Args<T>& a, const T* dout, const T* lse, const T* out, T scale, T* dq, T* dk, T* dv,
                   int64_t rows_kv, int64_t P) {
  if (use_tiles(a, static_cast<const T*>(nullptr)))
    backward_tiles(a, dout, lse, out, scale, dq, dk, dv, rows_kv, P);
  else
    backward_tokens(a, dout, lse, out, scale, dq, dk, dv, rows_kv, P);
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
