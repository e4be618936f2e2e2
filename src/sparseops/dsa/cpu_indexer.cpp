// The lightning indexer on the CPU (docs/dsa.md, "The C++ CPU path"): its exact top-k (select), and its score
// backward (backward): per query token, its selected keys read in place, the head dim in the lanes of a vector.
//
// scores[t, i] = sum_h w[t, h] * relu(q[t, h] . k[key(t, i)]) at the slots i not -1; given g = d scores:
//   dw[t, h] += relu(q[t, h] . k_i) * g[t, i]
//   dq[t, h] += [q[t, h] . k_i > 0] * w[t, h] * g[t, i] * k_i
//   dk_i     += [q[t, h] . k_i > 0] * w[t, h] * g[t, i] * q[t, h]
// One item per token (its dq, dw rows are its own); dk goes into one buffer per task, added in task order by
// the caller: bitwise repeatable for a given thread count. Arguments arrive validated and contiguous.
#include <torch/extension.h>

#include "cpu.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

namespace {

using sparseops_simd::load;
using sparseops_simd::store;
using sparseops_simd::Vec;

// sum_d a[d] * b[d]
template <typename T> inline T dot(const T* a, const T* b, int64_t D) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  V acc{};
  int64_t d = 0;
  for (; d + W <= D; d += W) acc += load<T>(a + d) * load<T>(b + d);
  T s = sparseops_simd::hsum(acc);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// y[d] += c * x[d]
template <typename T> inline void axpy(T c, const T* x, T* y, int64_t D) {
  constexpr int W = Vec<T>::W;
  int64_t d = 0;
  for (; d + W <= D; d += W) store<T>(y + d, load<T>(y + d) + c * load<T>(x + d));
  for (; d < D; ++d) y[d] += c * x[d];
}

template <typename T>
void backward_impl(const T* q, const T* k, const T* w, const int64_t* ids, const int64_t* start, const T* g,
                   int64_t T1, int64_t Hi, int64_t Di, int64_t K, int64_t rows_k, T* dq, T* dk, T* dw, int64_t P) {
  const int64_t blocks = (T1 + 3) / 4;
  sparseops_simd::run_tasks(P, [&](int64_t tid) {
    T* dkt = dk + tid * rows_k * Di;
    for (int64_t b = tid; b < blocks; b += P)
      for (int64_t t = b * 4; t < std::min(T1, b * 4 + 4); ++t) {
        const T* qt = q + t * Hi * Di;
        T* dqt = dq + t * Hi * Di;
        for (int64_t i = 0; i < K; ++i) {
          const int64_t id = ids[t * K + i];
          if (id < 0) continue;
          const int64_t row = start[t] + id;
          const T* kr = k + row * Di;
          T* dkr = dkt + row * Di;
          const T gi = g[t * K + i];
          for (int64_t h = 0; h < Hi; ++h) {
            const T x = dot(qt + h * Di, kr, Di);
            if (!(x > 0)) continue;
            dw[t * Hi + h] += x * gi;
            const T c = w[t * Hi + h] * gi;
            axpy(c, kr, dqt + h * Di, Di);
            axpy(c, qt + h * Di, dkr, Di);
          }
        }
      }
  });
}

// The exact top-k of each query row: I[s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the row's visible keys (the
// sequence's first nk), keys in the lanes of a vector (kT: the keys transposed, [Di, ld] with at least W columns
// of padding); the kk = min(topk, nk) largest, ties to the smaller position, in descending score with equal
// scores in position order (NaN counts as -inf).
template <typename T>
void select_impl(const T* q, const T* kT, int64_t ld, const T* w, const int64_t* start, const int64_t* nvis,
                 int64_t T1, int64_t Hi, int64_t Di, int64_t topk, int32_t* out_idx, T* out_sc, int64_t P) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  const int64_t blocks = (T1 + 3) / 4;
  const T ninf = -std::numeric_limits<T>::infinity();
  int64_t most = 0;
  for (int64_t t = 0; t < T1; ++t) most = std::max(most, nvis[t]);
  sparseops_simd::run_tasks(P, [&](int64_t tid) {
    std::vector<T> sc(most + W), tmp(most);
    std::vector<std::pair<T, int64_t>> pick(topk);
    for (int64_t b = tid; b < blocks; b += P)
      for (int64_t t = b * 4; t < std::min(T1, b * 4 + 4); ++t) {
        const int64_t nk = nvis[t], kk = std::min(topk, nk);
        if (nk == 0) continue;
        const T* qt = q + t * Hi * Di;
        const T* wt = w + t * Hi;
        const T* base = kT + start[t];
        for (int64_t s0 = 0; s0 < nk; s0 += 2 * W) {
          V i0{}, i1{};
          int64_t h = 0;
          for (; h + 4 <= Hi; h += 4) {  // 4 heads x 2 key vectors: 8 accumulators, one load per 4 FMAs
            V a[4][2] = {};
            for (int64_t d = 0; d < Di; ++d) {
              const V k0 = load<T>(base + d * ld + s0), k1 = load<T>(base + d * ld + s0 + W);
#pragma GCC unroll 4
              for (int c = 0; c < 4; ++c) {
                const T x = qt[(h + c) * Di + d];
                a[c][0] += x * k0;
                a[c][1] += x * k1;
              }
            }
            for (int c = 0; c < 4; ++c) {
              i0 += wt[h + c] * (a[c][0] > 0 ? a[c][0] : V{});
              i1 += wt[h + c] * (a[c][1] > 0 ? a[c][1] : V{});
            }
          }
          for (; h < Hi; ++h) {
            V a0{}, a1{};
            for (int64_t d = 0; d < Di; ++d) {
              const T x = qt[h * Di + d];
              a0 += x * load<T>(base + d * ld + s0);
              a1 += x * load<T>(base + d * ld + s0 + W);
            }
            i0 += wt[h] * (a0 > 0 ? a0 : V{});
            i1 += wt[h] * (a1 > 0 ? a1 : V{});
          }
          store<T>(sc.data() + s0, i0);
          if (s0 + W < nk) store<T>(sc.data() + s0 + W, i1);
        }
        for (int64_t s = 0; s < nk; ++s)
          if (sc[s] != sc[s]) sc[s] = ninf;
        int64_t n = 0;
        if (nk <= kk) {
          for (int64_t s = 0; s < nk; ++s) pick[n++] = {sc[s], s};
        } else {  // the kk-th largest value v: every key above it, then the first keys equal to it
          std::copy(sc.begin(), sc.begin() + nk, tmp.begin());
          std::nth_element(tmp.begin(), tmp.begin() + (kk - 1), tmp.begin() + nk, std::greater<T>());
          const T v = tmp[kk - 1];
          int64_t above = 0;
          for (int64_t s = 0; s < nk; ++s) above += sc[s] > v;
          int64_t ties = kk - above;
          for (int64_t s = 0; s < nk && n < kk; ++s)
            if (sc[s] > v || (sc[s] == v && ties-- > 0)) pick[n++] = {sc[s], s};
        }
        std::sort(pick.begin(), pick.begin() + n, [](const std::pair<T, int64_t>& x, const std::pair<T, int64_t>& y) {
          return x.first > y.first || (x.first == y.first && x.second < y.second);
        });
        int32_t* oi = out_idx + t * topk;
        T* os = out_sc + t * topk;
        for (int64_t i = 0; i < n; ++i) {
          os[i] = pick[i].first;
          oi[i] = pick[i].first == ninf ? -1 : static_cast<int32_t>(pick[i].second);
        }
      }
  });
}

void topk_select(torch::Tensor q, torch::Tensor kT, torch::Tensor w, torch::Tensor start, torch::Tensor nvis,
            torch::Tensor out_idx, torch::Tensor out_sc, int64_t tasks) {
  const int64_t T1 = q.size(0), Hi = q.size(1), Di = q.size(2), topk = out_idx.size(1), ld = kT.size(1);
  if (q.scalar_type() == torch::kFloat64)
    select_impl<double>(q.data_ptr<double>(), kT.data_ptr<double>(), ld, w.data_ptr<double>(),
                        start.data_ptr<int64_t>(), nvis.data_ptr<int64_t>(), T1, Hi, Di, topk,
                        out_idx.data_ptr<int32_t>(), out_sc.data_ptr<double>(), tasks);
  else
    select_impl<float>(q.data_ptr<float>(), kT.data_ptr<float>(), ld, w.data_ptr<float>(), start.data_ptr<int64_t>(),
                       nvis.data_ptr<int64_t>(), T1, Hi, Di, topk, out_idx.data_ptr<int32_t>(),
                       out_sc.data_ptr<float>(), tasks);
}

void backward(torch::Tensor q, torch::Tensor k, torch::Tensor w, torch::Tensor ids, torch::Tensor start,
              torch::Tensor g, torch::Tensor dq, torch::Tensor dk, torch::Tensor dw, int64_t tasks) {
  const int64_t T1 = q.size(0), Hi = q.size(1), Di = q.size(2), K = ids.size(1), rows_k = k.size(0);
  if (q.scalar_type() == torch::kFloat64)
    backward_impl<double>(q.data_ptr<double>(), k.data_ptr<double>(), w.data_ptr<double>(), ids.data_ptr<int64_t>(),
                          start.data_ptr<int64_t>(), g.data_ptr<double>(), T1, Hi, Di, K, rows_k,
                          dq.data_ptr<double>(), dk.data_ptr<double>(), dw.data_ptr<double>(), tasks);
  else
    backward_impl<float>(q.data_ptr<float>(), k.data_ptr<float>(), w.data_ptr<float>(), ids.data_ptr<int64_t>(),
                         start.data_ptr<int64_t>(), g.data_ptr<float>(), T1, Hi, Di, K, rows_k,
                         dq.data_ptr<float>(), dk.data_ptr<float>(), dw.data_ptr<float>(), tasks);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("select", &topk_select, "DSA indexer exact top-k (CPU, keys in vector lanes)");
  mod.def("backward", &backward, "DSA indexer score backward (CPU, selected keys per token)");
}
