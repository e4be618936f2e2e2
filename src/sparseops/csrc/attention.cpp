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
//   causal, p <= pos: the rule of the reference (sparseops/nsa/reference.py). The ids themselves are not
//   validated (validate=False, torch.compile): an id outside [0, ceil(S2 / bs)) is an empty slot, tested before
//   idx * bs is formed.
//
// Layout of the work (attention_tiles.h): the G query heads of a KV head fill the W lanes of a 64-byte vector (16
// fp32 / 8 float64; more heads take several items, fewer leave lanes at 0); an item is a tile of consecutive query
// tokens, and two tokens' keys over the same rows run as one unit. dK / dV go into one private buffer per task; the
// Python side adds the buffers in task order, and each task's items are fixed by the item index alone: the
// backward is bitwise repeatable for a given thread count.
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

// p[t, i] = (1 / N1) sum_h softmax_i(s[t, h, :]) over the slots i of indices[t] in [0, len[t]) (0 elsewhere, as at
// -1): the attention's head-averaged distribution over a token's selected keys, the DSA indexer loss's target. One
// item per token (all its KV heads), so each row of p is written by one task.
template <typename T>
void head_mean_impl(const T* q, const T* k, const int64_t* ids, const int64_t* start, const int64_t* len, int64_t T1,
                    int64_t N1, int64_t N2, int64_t D, int64_t K, T floor, T qscale, T* p, int64_t P) {
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
          if (live_block(ids[t * K + i], len[t])) {
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

void head_mean_probs(Tensor q, Tensor k, Tensor ids, Tensor start, Tensor len, double floor, double scale,
                     Tensor p, int64_t tasks) {
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    head_mean_impl<T>(q.data_ptr<T>(), k.data_ptr<T>(), ids.data_ptr<int64_t>(), start.data_ptr<int64_t>(),
                      len.data_ptr<int64_t>(), q.size(0), q.size(1), k.size(1), q.size(2), ids.size(1), T(floor),
                      T(scale), p.data_ptr<T>(), tasks);
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
  a.R = k.size(0) * k.size(1);
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
    forward_tiles(make_args<T>(q, k, v, topk, kv_start, seq_len, pos, bs, causal, floor, scale), out.data_ptr<T>(),
                  m.data_ptr<T>(), l.data_ptr<T>(), want ? tg.data_ptr<T>() : nullptr, tasks);
  });
}

void backward(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor lse,
              Tensor out, Tensor topk, Tensor kv_start, Tensor seq_len,
              Tensor pos, int64_t bs, bool causal, double floor, double scale, Tensor dq,
              Tensor dk, Tensor dv, int64_t tasks) {
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    backward_tiles(make_args<T>(q, k, v, topk, kv_start, seq_len, pos, bs, causal, floor, scale),
                   dout.data_ptr<T>(), lse.data_ptr<T>(), out.data_ptr<T>(), T(scale), dq.data_ptr<T>(),
                   dk.data_ptr<T>(), dv.data_ptr<T>(), tasks);
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
    forward_tiles(range_args<T>(q, k, v, lo, hi, K, floor, scale), out.data_ptr<T>(), m.data_ptr<T>(),
                  l.data_ptr<T>(), static_cast<T*>(nullptr), tasks);
  });
}

void backward_ranges(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor lse, Tensor out, Tensor lo, Tensor hi,
                     int64_t K, double floor, double scale, Tensor dq, Tensor dk, Tensor dv, int64_t tasks) {
  sparseops_simd::by_dtype(q, [&](auto z) {
    using T = decltype(z);
    backward_tiles(range_args<T>(q, k, v, lo, hi, K, floor, scale), dout.data_ptr<T>(), lse.data_ptr<T>(),
                   out.data_ptr<T>(), T(scale), dq.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>(), tasks);
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
