// The lightning indexer's score backward on the CPU (docs/dsa.md, "The C++ CPU path"): per query token, its
// selected keys read in place, the head dim in the lanes of a vector.
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
  mod.def("backward", &backward, "DSA indexer score backward (CPU, selected keys per token)");
}
