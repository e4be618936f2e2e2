// What the C++ CPU kernels share (docs/internals.md): vectors of one 64-byte register (GCC / Clang vector
// extensions: AVX-512 where the CPU has it, two or four narrower registers elsewhere), a vector exp, tasks on
// threads of their own, and the tensor arguments without torch's headers.
#pragma once

#include <pybind11/pybind11.h>

#include <cmath>
#include <string>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace sparseops_simd {

template <typename T> struct Vec;
template <> struct Vec<float> {
  typedef float type __attribute__((vector_size(64)));
  typedef int itype __attribute__((vector_size(64)));
  static constexpr int W = 16;
};
template <> struct Vec<double> {
  typedef double type __attribute__((vector_size(64)));
  typedef long long itype __attribute__((vector_size(64)));
  static constexpr int W = 8;
};

template <typename T> inline typename Vec<T>::type load(const T* p) {
  typename Vec<T>::type x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <typename T> inline void store(T* p, typename Vec<T>::type x) { std::memcpy(p, &x, sizeof(x)); }

// exp of each lane for arguments in [-80, 80] (the callers clamp): Cephes' expf polynomial (about 1 ulp).
inline Vec<float>::type vexp(Vec<float>::type x) {
  typedef Vec<float>::type V;
  typedef Vec<float>::itype I;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting rounds to the nearest integer
  V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693359375f - n * -2.12194440e-4f;
  V z = r * r;
  V y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
         1.6666665459e-1f) * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  I e = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return y * scale;
}
// float64 is the testing dtype: the library's exp, lane by lane.
inline Vec<double>::type vexp(Vec<double>::type x) {
  for (int i = 0; i < Vec<double>::W; ++i) x[i] = std::exp(x[i]);
  return x;
}

// The sum of a vector's lanes, by halves (a tree: a few shuffles instead of W dependent adds).
inline float hsum(Vec<float>::type v) {
  typedef float V8 __attribute__((vector_size(32)));
  typedef float V4 __attribute__((vector_size(16)));
  V8 a, b;
  std::memcpy(&a, &v, 32);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + 32, 32);
  a += b;
  V4 c, d;
  std::memcpy(&c, &a, 16);
  std::memcpy(&d, reinterpret_cast<const char*>(&a) + 16, 16);
  c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}
inline double hsum(Vec<double>::type v) {
  typedef double V4 __attribute__((vector_size(32)));
  V4 a, b;
  std::memcpy(&a, &v, 32);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + 32, 32);
  a += b;
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// Asks for the n values of T at p ahead of their use (rows gathered by index: the hardware prefetcher cannot
// guess them); rw: for writing.
template <typename T> inline void prefetch_row(const T* p, int64_t n, bool rw = false) {
  for (int64_t b = 0; b < n * int64_t(sizeof(T)); b += 64) {
    if (rw)
      __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 1, 3);
    else
      __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, 3);
  }
}

// The little of a torch.Tensor a kernel reads (data pointer, sizes, whether float64), taken from its Python
// attributes: the kernels include no torch header, whose compile would be most of a build. Arguments arrive
// validated and contiguous from the Python side.
struct Tensor {
  void* ptr = nullptr;
  std::vector<int64_t> shape;
  bool f64 = false;
  Tensor() = default;
  explicit Tensor(const pybind11::handle& t)
      : ptr(reinterpret_cast<void*>(t.attr("data_ptr")().cast<uintptr_t>())),
        f64(pybind11::str(t.attr("dtype")).cast<std::string>() == "torch.float64") {
    for (auto s : t.attr("shape")) shape.push_back(s.cast<int64_t>());
  }
  int64_t size(int i) const { return shape[i]; }
  template <typename T> T* data_ptr() const { return static_cast<T*>(ptr); }
};

// fn(T()) with T the tensor's arithmetic type (double for float64, else float): an entry point's one call for both
// dtypes, `using T = decltype(z);` inside a generic lambda.
template <typename F> void by_dtype(const Tensor& x, F fn) {
  if (x.f64)
    fn(double());
  else
    fn(float());
}

// Runs task(tid) for tid in [0, P), one thread each (task 0 on the caller's). Threads of their own: ATen's
// parallel_for is OpenMP code inlined into the caller, and these builds are not compiled with OpenMP.
template <typename F> void run_tasks(int64_t P, F task) {
  std::vector<std::thread> pool;
  for (int64_t tid = 1; tid < P; ++tid) pool.emplace_back(task, tid);
  task(0);
  for (auto& th : pool) th.join();
}

}  // namespace sparseops_simd

namespace pybind11 {
namespace detail {
// a torch.Tensor argument arrives as a sparseops_simd::Tensor
template <> struct type_caster<sparseops_simd::Tensor> {
  PYBIND11_TYPE_CASTER(sparseops_simd::Tensor, const_name("torch.Tensor"));
  bool load(handle src, bool) {
    if (!hasattr(src, "data_ptr")) return false;
    value = sparseops_simd::Tensor(src);
    return true;
  }
  static handle cast(const sparseops_simd::Tensor&, return_value_policy, handle) { return none().release(); }
};
}  // namespace detail
}  // namespace pybind11
