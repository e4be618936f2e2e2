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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
#if defined(__AVX512F__)
// r[i][j] <- r[j][i] for a 16 x 16 fp32 block in 16 registers: 64 shuffles (within 128-bit lanes, then across them).
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + c], 128-bit lane k: rows g .. g + 3 at column 4k + c
    u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
    u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
    u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
    u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(x0, y0, 0xdd);
    r[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xdd);
  }
}
#endif

// cols[d][l] = mul * src[l * ld + d] for the n <= W rows l (0 on the other lanes), d < D: rows into vector lanes
// (the kernels' heads in lanes), by 16 x 16 register transposes where the CPU has AVX-512.
template <typename T>
void rows_to_lanes(const T* src, int64_t n, int64_t D, int64_t ld, T mul, typename Vec<T>::type* cols) {
  typedef typename Vec<T>::type V;
  int64_t d0 = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 m = _mm512_set1_ps(mul);
    for (; d0 + 16 <= D; d0 += 16) {
      __m512 r[16];
      for (int l = 0; l < 16; ++l)
        r[l] = l < n ? _mm512_mul_ps(_mm512_loadu_ps(src + l * ld + d0), m) : _mm512_setzero_ps();
      transpose16(r);
      for (int i = 0; i < 16; ++i) cols[d0 + i] = V(r[i]);
    }
  }
#endif
  for (; d0 < D; ++d0) {
    V c{};
    for (int64_t l = 0; l < n; ++l) c[l] = src[l * ld + d0] * mul;
    cols[d0] = c;
  }
}

// dst[l * ld + d] = cols[d][l] * mul[l] for the n <= W rows l, d < D: the reverse of rows_to_lanes.
template <typename T>
void lanes_to_rows(const typename Vec<T>::type* cols, int64_t n, int64_t D, typename Vec<T>::type mul, T* dst,
                   int64_t ld) {
  int64_t d0 = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    for (; d0 + 16 <= D; d0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = __m512(cols[d0 + i]);
      transpose16(r);
      for (int l = 0; l < n; ++l) _mm512_storeu_ps(dst + l * ld + d0, _mm512_mul_ps(r[l], _mm512_set1_ps(mul[l])));
    }
  }
#endif
  for (int64_t l = 0; l < n; ++l)
    for (int64_t d = d0; d < D; ++d) dst[l * ld + d] = cols[d][l] * mul[l];
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
