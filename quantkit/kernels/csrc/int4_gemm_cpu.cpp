// W4A16 weight-only GEMM for x86 CPUs with AVX2 + FMA (built with -O3 -mavx2 -mfma -fopenmp).
//
// y[m, n] = sum_k x[m, k] * (q[n, k] - zeros[n, g]) * scales[n, g],  g = k / group_size
//         = sum_g s[n, g] * (sum_{k in g} x[m, k] * q[n, k])  -  sum_g s[n, g] * z[n, g] * xsum[m, g]
// so the inner loop is a float dot product of x with the raw nibbles; scales are applied once per group and the
// zero term once per output from xsum (computed once per call).
//
// Packing: within each run of 16 consecutive k, byte j (0..7) holds q[k0 + j] in its low nibble and q[k0 + 8 + j]
// in its high nibble, so 8 bytes widen to 8 int32 lanes whose `& 0xF` and `>> 4` line up with two contiguous
// 8-float loads of x.
// Only ATen and the op registry are included (not torch/extension.h): the build drops from ~50 s to ~15 s.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace {

constexpr int64_t kRowBlock = 4;  // output rows per OpenMP work item (the M=1 kernel keeps 4 rows in registers)
// Above this many x rows the GEMV kernels lose to dequantizing into float and running sgemm (1 thread, group 64,
// SmolLM2 gate/down shapes: the two cross between M=8 and M=12).
constexpr int64_t kMaxFusedM = 8;
// Prefill path: dequantize this many weight rows at a time into a scratch buffer (1.5 MB at K=1536, small
// enough to stay in cache for sgemm). Measured at M=512, 1 thread: N=1536 K=576 12-14 ms against 21-24 ms for one
// dequantize of the whole weight and one matmul; N=576 K=1536 about equal.
constexpr int64_t kDequantRows = 256;
// The GEMV reads a row block as 4 interleaved streams. Software-prefetching the next block (weights, scales,
// zeros) took M=1 over 30 distinct weights, i.e. weights not in L2 (1 thread, mean of 4 runs), from ~177 to ~95 us
// at N=576 K=1536 and from ~107 to ~95 us at N=1536 K=576; 2, 4 or 8 blocks ahead did worse.
constexpr int64_t kPrefetchBlocks = 1;
// Below this many weights a call stays on one thread (torch's own grain size is 32768 elements): a parallel region
// costs a few us, and far more when another process holds the cores and the team waits for a descheduled thread
// (a 2-layer test model ran 10x slower than fp32 that way).
constexpr int64_t kParallelMinWeights = 1 << 16;

inline void unpack16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_g a[g] * b[g] * c[g]
inline float dot3(const float* a, const float* b, const float* c, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)), _mm256_loadu_ps(c + i), acc);
  float r = hsum(acc);
  for (; i < n; ++i) r += a[i] * b[i] * c[i];
  return r;
}

struct Problem {
  const float* x;      // [M, K]
  const uint8_t* w;    // [N, K/2]
  const float* s;      // [N, G]
  const float* z;      // [N, G]
  const float* xsum;   // [M, G]
  float* y;            // [M, N]
  int64_t N, K, G, gs;
};

// y[m0:m0+MB, n0:n0+RB]. Low and high nibbles feed separate accumulators, so RB * MB = 4 gives 8 independent FMA
// chains (enough to hide FMA latency on 2 ports) while accumulators and group totals still fit in 16 ymm registers.
template <int RB, int MB>
void gemv_tile(const Problem& p, int64_t n0, int64_t m0) {
  const int64_t K = p.K, G = p.G, gs = p.gs, half = K / 2;
  __m256 tot[MB][RB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < RB; ++r) tot[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* w = p.w + n0 * half + g * (gs / 2);
    const float* x = p.x + m0 * K + g * gs;
    __m256 acc_lo[MB][RB], acc_hi[MB][RB];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < RB; ++r) acc_lo[m][r] = acc_hi[m][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < gs / 16; ++i) {
      for (int r = 0; r < RB; ++r) {
        __m256 lo, hi;
        unpack16(w + r * half + 8 * i, lo, hi);
        for (int m = 0; m < MB; ++m) {
          acc_lo[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + 16 * i), lo, acc_lo[m][r]);
          acc_hi[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + 16 * i + 8), hi, acc_hi[m][r]);
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      const __m256 sg = _mm256_broadcast_ss(p.s + (n0 + r) * G + g);
      for (int m = 0; m < MB; ++m)
        tot[m][r] = _mm256_fmadd_ps(_mm256_add_ps(acc_lo[m][r], acc_hi[m][r]), sg, tot[m][r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    const float* s = p.s + (n0 + r) * G;
    const float* z = p.z + (n0 + r) * G;
    for (int m = 0; m < MB; ++m)
      p.y[(m0 + m) * p.N + n0 + r] = hsum(tot[m][r]) - dot3(s, z, p.xsum + (m0 + m) * G, G);
  }
}

template <int MB>
void rows_one_by_one(const Problem& p, int64_t n0, int64_t rows, int64_t m0) {
  for (int64_t r = 0; r < rows; ++r) gemv_tile<1, MB>(p, n0 + r, m0);
}

// All M rows of x against weight rows [n0, n0 + rows): x rows go 4 (or a remainder of 3) at a time against one
// weight row, so one unpack feeds several FMAs; a remainder of 2 against 2 weight rows, of 1 against 4.
void gemv_rows(const Problem& p, int64_t M, int64_t n0, int64_t rows) {
  const bool full = rows == kRowBlock;
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) rows_one_by_one<4>(p, n0, rows, m0);
  switch (M - m0) {
    case 3:
      rows_one_by_one<3>(p, n0, rows, m0);
      break;
    case 2:
      if (full) {
        gemv_tile<2, 2>(p, n0, m0);
        gemv_tile<2, 2>(p, n0 + 2, m0);
      } else {
        rows_one_by_one<2>(p, n0, rows, m0);
      }
      break;
    case 1:
      if (full) gemv_tile<4, 1>(p, n0, m0);
      else rows_one_by_one<1>(p, n0, rows, m0);
      break;
  }
}

// out[r, k] = (q[n0 + r, k] - z) * s for rows [n0, n0 + rows)
void dequant_rows(const uint8_t* packed, const float* scales, const float* zeros, int64_t K, int64_t G, int64_t gs,
                  int64_t n0, int64_t rows, float* out) {
#pragma omp parallel for schedule(static) if (rows * K >= kParallelMinWeights)
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* w = packed + (n0 + r) * (K / 2);
    float* o = out + r * K;
    for (int64_t g = 0; g < G; ++g) {
      const float s = scales[(n0 + r) * G + g];
      const __m256 sv = _mm256_set1_ps(s), bias = _mm256_set1_ps(-zeros[(n0 + r) * G + g] * s);
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
        __m256 lo, hi;
        unpack16(w + k / 2, lo, hi);
        _mm256_storeu_ps(o + k, _mm256_fmadd_ps(lo, sv, bias));
        _mm256_storeu_ps(o + k + 8, _mm256_fmadd_ps(hi, sv, bias));
      }
    }
  }
}

at::Tensor int4_gemm(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor zeros, int64_t group_size) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "int4_gemm: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "int4_gemm: packed must be a contiguous 2-D uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(K % 16 == 0, "int4_gemm: K must be a multiple of 16, got ", K);
  TORCH_CHECK(packed.size(1) * 2 == K, "int4_gemm: packed is [", N, ", ", packed.size(1), "], expected [", N, ", ",
              K / 2, "]");
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0,
              "int4_gemm: group_size must be a multiple of 16 dividing K=", K, ", got ", group_size);
  const int64_t G = K / group_size;
  for (const auto& t : {scales, zeros})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == N &&
                    t.size(1) == G,
                "int4_gemm: scales and zeros must be contiguous float32 [", N, ", ", G, "]");

  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (M > kMaxFusedM) {
    const int64_t block = std::min(N, kDequantRows);
    auto w = at::empty({block, K}, x.options());
    for (int64_t n0 = 0; n0 < N; n0 += block) {
      const int64_t rows = std::min(block, N - n0);
      dequant_rows(packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), K, G, group_size,
                   n0, rows, w.data_ptr<float>());
      y.narrow(1, n0, rows).copy_(at::mm(x, w.narrow(0, 0, rows).t()));
    }
    return y;
  }

  // a plain loop: at::sum costs ~7 us a call here, half of a whole k_proj GEMV at M=1
  std::vector<float> xsum(M * G);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < M * G; ++i) xsum[i] = std::accumulate(xp + i * group_size, xp + (i + 1) * group_size, 0.f);
  const Problem p{xp, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), xsum.data(),
                  y.data_ptr<float>(), N, K, G, group_size};
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static) if (N * K >= kParallelMinWeights)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * kRowBlock, ahead = n0 + kPrefetchBlocks * kRowBlock;
    if (ahead < N) {
      const int64_t rows = std::min(kRowBlock, N - ahead);
      prefetch(p.w + ahead * (K / 2), rows * (K / 2));
      prefetch(p.s + ahead * G, rows * G * sizeof(float));
      prefetch(p.z + ahead * G, rows * G * sizeof(float));
    }
    gemv_rows(p, M, n0, std::min(kRowBlock, N - n0));
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(quantkit_int4, m) {
  m.def("int4_gemm(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantkit_int4, CPU, m) { m.impl("int4_gemm", &int4_gemm); }
