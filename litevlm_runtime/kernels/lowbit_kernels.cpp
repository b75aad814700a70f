// Low-bit weight matmuls for x86 CPUs with AVX2 + FMA + F16C, and an int4 loop for AVX-512 VNNI
// chosen at run time (lowbit_kernels.py builds and loads this file; quantize.py defines the formats).
// Written here because no maintained library measured faster on this CPU class (AVX2 Zen 3; on Zen 4
// the same holds): docs/performance.md has the candidates table.
//
// Small calls (decode steps, small trees: memory-bound, one pass over the weights):
//   int4: the activation rows are quantized to int8 per block of 64 (scale = max|x| / 127, round to
//         nearest), then int4 codes x int8 with vpmaddubsw (unsigned codes x signed activations, exact
//         in int16: 4 * 15 * 127 < 2^15 for the two products of a block summed) and vpmaddwd,
//         accumulated in float32 per block, per group scaled, the zero points subtracted once per
//         row through the activations' group sums (llama.cpp's Q4_0 x Q8_0 scheme, with a zero
//         point, a group of G and 64-element activation blocks: one 32-byte load of codes each).
//         The weights' modules hold them in tiles of 8 rows (int4_tiles8: one stream, one register
//         for 8 rows' sums, as llama.cpp's repacked Q4_0 on AVX2); the row layout's loops (AVX2,
//         AVX-512 VNNI) serve weights given in rows.
//   int8: the same with signed int8 weights, activation blocks of 32 (vpsignb moves the weight's
//         sign onto the activation).
//   fp16: float activations, fp16 weights widened in registers (vcvtph2ps) and FMA: exact products.
// Large calls (prefill: compute-bound): int4/int8 with prefill_int8, the activations quantized to
//   int8 per block of 128 and an int8 GEMM of our own (vnni_gemm, below: AVX-512 VNNI micro-tiles
//   where the CPU has them, else AVX2 ones); otherwise the weights are dequantized tile by tile (a
//   few MB, cache resident) into a scratch buffer and multiplied by the GEMM at::mm runs
//   (MKL/oneDNN): float32 (exact float activations) or, with prefill_bf16, bfloat16 (tiled_gemm);
//   the weights are read from memory at their low-bit size either way.
// Threads: as many as torch.set_num_threads (or set_small_call_threads) says. Large calls run on
//   torch's own OpenMP pool (at::parallel_for; compiled with -fopenmp but linked to no OpenMP
//   library of its own, so its regions run on the runtime libtorch already loaded, with the passive
//   wait policy of threads.py). Small calls share their rows out in chunks from a counter to the
//   caller and this file's own helpers (RowPool: asleep between calls, awake a few microseconds
//   first where the CPU has room), and wait only for chunks a running helper has taken, so a
//   descheduled thread does not hold a step back.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include "kernel_ops.h"
#include "simd_avx2.h"
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <fcntl.h>
#include <unistd.h>
#include <vector>

namespace {

constexpr int QBLOCK8 = 32;  // int8 kernel: activations quantized per block of 32 (one 32-byte load of weights)
constexpr int QBLOCK4 = 64;  // int4 kernel: per block of 64 (one 32-byte load of codes: 64 weights)
constexpr int QBLOCK_MAX = 128;  // the int8 prefill GEMM's block (vnni_gemm): the largest block quantized

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// Software prefetch of the weights a tile reads next. Why: a tile reads R weight rows side by side,
// i.e. R streams a row length apart, and the hardware prefetcher follows such interleaved streams
// poorly: without this the int4 kernel read 4-6 GB/s from memory on 2 threads where a plain sum over
// the same bytes read 15-19 GB/s, although it ran at ~16 GB/s per thread with the weights in cache
// (it was waiting on memory, not computing). Two schemes (measured at InternVL3-2B's shapes, 2
// threads, against the kernel without prefetch in the same run):
//  - a small tile (R rows <= PREFETCH_TILE_MAX bytes, so that it and the next one fit in the 32 KB
//    L1 together; K = 1536: 3-12 KB): the next tile's R rows are contiguous, so step i of this
//    tile fetches the i-th slice of it. The prefetches walk one sequential stream, which the
//    hardware prefetcher picks up too: 2-2.3x (int4 reached 14-18 GB/s, the plain sum's rate).
//  - a large tile (K = 8960, the down projection: 18-72 KB; the next tile would push this one out
//    of L1): each row's own stream PREFETCH_BYTES ahead, crossing at a row's end into the row R
//    further on (the next tile's): 1.2-2x there, where the next-tile scheme gained 1.0-1.1x.
// A prefetch past the end of the weights (the last tile) does not fault.
// prefetcht0 is an asm statement: g++ 12 at -O1 and above deleted every _mm_prefetch of this
// two-scheme function (none left in the object code) while it kept those of a one-scheme version;
// an asm volatile statement stays where it is written.
inline void prefetch_line(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }

constexpr int64_t PREFETCH_BYTES = 1024;
constexpr int64_t PREFETCH_TILE_MAX = 16 << 10;
// Called at step i of a tile of R rows at `tile` (row_bytes apart) that reads STEP bytes of each row per step.
template <int R, int STEP>
inline void prefetch_ahead(const uint8_t* tile, int64_t row_bytes, int64_t i) {
  if (R * row_bytes <= PREFETCH_TILE_MAX) {
    const uint8_t* p = tile + R * row_bytes + i * (R * STEP);
    for (int j = 0; j < R * STEP; j += 64) prefetch_line(p + j);
  } else if ((i * STEP) % 64 == 0) {        // a line per row once per 64 bytes of it
    const int64_t pos = i * STEP + PREFETCH_BYTES;
    const uint8_t* p = tile + (pos < row_bytes ? pos : pos + (R - 1) * row_bytes);
    for (int r = 0; r < R; ++r) prefetch_line(p + r * row_bytes);
  }
}

// The order xq holds a block's codes in (quantize_activations): as x, or as a 32-byte load of int4
// codes splits into low (even k) and high (odd k) nibbles: a block's even elements, then its odd ones
// (ORDER_INT4: the row-layout loops), or each 8 elements' 4 even then 4 odd (ORDER_STEPS8: one step of
// the 8-row tiles' loop, int4_tiles8).
constexpr int ORDER_NATURAL = 0, ORDER_INT4 = 1, ORDER_STEPS8 = 2;

// Activations [M, K] (times pre_quant_scale when given) -> int8 per block of `block`: xq [M, K]
// (in `order`), dx [M, K/block] (the block's scale, max|x| / 127), bsum [M, K/block] (the block's sum
// of codes, for the zero point).
void quantize_activations(const float* x, const float* pqs, int64_t M, int64_t K, int block, int order,
                          int8_t* xq, float* dx, int32_t* bsum) {
  // In AVX2, 8 elements at a time, with the scalar version's operations element by element (the
  // product with pre_quant_scale, the IEEE division by the block's scale, round half to even as
  // nearbyint does in the default rounding mode): the same codes, bit for bit. Written so because
  // the scalar loop (a division per element) costs several cycles an element (estimated ~0.5-1 ms of
  // a 2B decode step's ~510k activation elements).
  const int64_t nb = K / block;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  alignas(32) float v[QBLOCK_MAX];
  alignas(32) int32_t q[QBLOCK_MAX];
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * block;
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < block; i += 8) {
        __m256 xv = _mm256_loadu_ps(xm + k0 + i);
        if (pqs) xv = _mm256_mul_ps(xv, _mm256_loadu_ps(pqs + k0 + i));
        _mm256_store_ps(v + i, xv);
        amax = _mm256_max_ps(_mm256_and_ps(xv, abs_mask), amax);   // a NaN element is skipped, as by fmax
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float d = _mm_cvtss_f32(h) / 127.0f;
      __m256i sum = _mm256_setzero_si256();
      const __m256 dv = _mm256_set1_ps(d);
      for (int i = 0; i < block; i += 8) {
        const __m256i qi = d > 0.f ? _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_load_ps(v + i), dv),
                                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
                                   : _mm256_setzero_si256();
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + i), qi);
        sum = _mm256_add_epi32(sum, qi);
      }
      int8_t* out = xq + m * K + k0;
      for (int i = 0; i < block; ++i) {
        const int pos = order == ORDER_INT4     ? (i % 2 ? block / 2 + i / 2 : i / 2)
                        : order == ORDER_STEPS8 ? i / 8 * 8 + (i % 2 ? 4 : 0) + i % 8 / 2
                                                : i;
        out[pos] = static_cast<int8_t>(q[i]);
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      dx[m * nb + b] = d;
      bsum[m * nb + b] = _mm_cvtsi128_si32(s4);
    }
  }
}

struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<int32_t> bsum;
};

QuantizedRows quantize_rows(const at::Tensor& x, const c10::optional<at::Tensor>& pqs, int block, int order) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedRows r;
  r.xq.resize(M * K);
  r.dx.resize(M * (K / block));
  r.bsum.resize(M * (K / block));
  quantize_activations(x.data_ptr<float>(), pqs ? pqs->data_ptr<float>() : nullptr, M, K, block, order,
                       r.xq.data(), r.dx.data(), r.bsum.data());
  return r;
}

// The activations' sum per weight group (int4's zero point): gx[m, g] = sum over the group's blocks
// of block scale x block sum of codes, i.e. the group's sum of dequantized activations. Once per
// call, shared by every weight row (it was recomputed per tile inside the group loop).
std::vector<float> group_sums(const QuantizedRows& a, int64_t M, int64_t K, int64_t G) {
  const int64_t ng = K / G, nb = K / QBLOCK4, bpg = G / QBLOCK4;
  std::vector<float> gx(M * ng);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ng; ++g) {
      float sum = 0.f;
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) sum += a.dx[m * nb + b] * static_cast<float>(a.bsum[m * nb + b]);
      gx[m * ng + g] = sum;
    }
  return gx;
}

// One weight row's zero-point term: sum over its groups of scale x zero x the activations' group
// sum, 8 groups at a time (scales widened by F16C, zeros by vpmovzxbd). Once per row after its
// group loop, where a scalar update per group and row had cost ~5 instructions per 64 weights.
inline float zero_point_term(const uint16_t* s, const uint8_t* z, const float* gx, int64_t ng) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8) {
    const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g)));
    const __m256 zv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + g))));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(sv, zv), _mm256_loadu_ps(gx + g), acc);
  }
  float t = hsum(acc);
  for (; g < ng; ++g) t += half_to_float(s[g]) * static_cast<float>(z[g]) * gx[g];
  return t;
}

// y[m, n0 + r] for R weight rows n0.. and every activation row m: int4 codes x int8 activations.
// Per block of 64 weights and row: one 32-byte load of codes, its low nibbles (the block's even k)
// and high nibbles (odd k) against the two halves of the reordered activation block, both
// products summed in int16 (4 * 15 * 127 < 2^15), widened once, scaled once; per group the
// weight scale; per row the zero point (zero_point_term, over the activations' group sums gx).
template <int R>
void int4_rows(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, int64_t n0, int64_t K, int64_t G,
               const QuantizedRows& a, const float* gx, int64_t M, float* y, int64_t ldy) {
  const int64_t ng = K / G, nb = K / QBLOCK4, bpg = G / QBLOCK4, row_bytes = K / 2;
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* xq = a.xq.data() + m * K;
    const float* dx = a.dx.data() + m * nb;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m256 ag[R];
      for (int r = 0; r < R; ++r) ag[r] = _mm256_setzero_ps();
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * QBLOCK4));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * QBLOCK4 + 32));
        const __m256 d = _mm256_set1_ps(dx[b]);
        if (m == 0) prefetch_ahead<R, QBLOCK4 / 2>(codes + n0 * row_bytes, row_bytes, b);
        for (int r = 0; r < R; ++r) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(codes + (n0 + r) * row_bytes + b * (QBLOCK4 / 2)));
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
          ag[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), d, ag[r]);
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(ag[r], _mm256_set1_ps(half_to_float(scales[(n0 + r) * ng + g])), acc[r]);
    }
    for (int r = 0; r < R; ++r)
      y[m * ldy + n0 + r] = hsum(acc[r]) - zero_point_term(scales + (n0 + r) * ng, zeros + (n0 + r) * ng, gx + m * ng, ng);
  }
}

// The same product on CPUs with AVX-512 VNNI (Zen 4, Ice Lake and later; `use_avx512`), two
// activation blocks per step: one 64-byte load holds the codes of blocks b and b+1, and vpdpbusd
// multiplies unsigned codes by signed activations and sums each four products straight into int32
// (the AVX2 loop's vpmaddubsw + vpaddw + vpmaddwd in one instruction, no int16 stage). Lanes 0-7
// carry block b, lanes 8-15 block b+1, so each is scaled by its own activation scale as before:
// the same integers, the same float32 operations per block, summed in another order (within 1e-5
// of the float64 product, as the AVX2 loop). Measured alone at a 2B model's shapes (2 threads, Zen
// 4, the loops alternating): 1.07-1.16x per matrix; over a whole decode step within the run-to-run
// spread, since the step then reads its weights from memory at ~19 GB/s whichever loop computes
// (docs/performance.md section 6). Needs an even number of blocks per group.
#define LITEVLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
template <int R>
LITEVLM_AVX512 void int4_rows_avx512(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, int64_t n0,
                                     int64_t K, int64_t G, const QuantizedRows& a, const float* gx, int64_t M, float* y,
                                     int64_t ldy) {
  const int64_t ng = K / G, nb = K / QBLOCK4, bpg = G / QBLOCK4, row_bytes = K / 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* xq = a.xq.data() + m * K;
    const float* dx = a.dx.data() + m * nb;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m512 ag[R];
      for (int r = 0; r < R; ++r) ag[r] = _mm512_setzero_ps();
      for (int64_t b = g * bpg; b < (g + 1) * bpg; b += 2) {
        // blocks b, b+1 of the activations, each [even k | odd k] (int4 order) -> evens of both, odds of both
        const __m512i x0 = _mm512_loadu_si512(xq + b * QBLOCK4), x1 = _mm512_loadu_si512(xq + (b + 1) * QBLOCK4);
        const __m512i xe = _mm512_shuffle_i64x2(x0, x1, 0x44), xo = _mm512_shuffle_i64x2(x0, x1, 0xEE);
        const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(dx[b]), _mm256_set1_ps(dx[b + 1]), 1);
        if (m == 0) prefetch_ahead<R, QBLOCK4>(codes + n0 * row_bytes, row_bytes, b / 2);
        for (int r = 0; r < R; ++r) {
          const __m512i v = _mm512_loadu_si512(codes + (n0 + r) * row_bytes + b * (QBLOCK4 / 2));
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          const __m512i p32 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
          ag[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p32), d, ag[r]);
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(ag[r], _mm512_set1_ps(half_to_float(scales[(n0 + r) * ng + g])), acc[r]);
    }
    for (int r = 0; r < R; ++r)
      y[m * ldy + n0 + r] =
          _mm512_reduce_add_ps(acc[r]) - zero_point_term(scales + (n0 + r) * ng, zeros + (n0 + r) * ng, gx + m * ng, ng);
  }
}

// Whether the int4 small-call kernel takes its AVX-512 VNNI loop: where the CPU has it, unless
// switched off (`use_avx512(false)`: the tests compare both loops on such a CPU, the benchmarks time them).
bool cpu_has_avx512_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}
const bool has_avx512_vnni = cpu_has_avx512_vnni();
std::atomic<bool> avx512_int4{has_avx512_vnni};

// ------------------------------------------------------------------------------ int4 in tiles of 8 rows
// The int4 weights' layout in memory where the kernels run them (weights/lowbit.py: tiles8, for N a
// multiple of 8): codes as tiles of 8 rows, each [K/8 steps][8 rows][4 bytes] (a step: the 4 bytes of
// each row that hold its k = 8s .. 8s + 7, even k in the low nibbles, as in the row layout), scales
// and zeros as [N/8][K/G][8]. The same bytes as the row layout, moved. Why: a tile of the row layout
// reads R streams a row apart and ends each row's block in a horizontal step (per row and block a
// widening, a conversion and an FMA; per group a scalar scale); here a tile reads one sequential
// stream, and one register holds the 8 rows' sums, so those steps are shared by 8 rows and the
// output is one store. Measured at InternVL3-2B's decode shapes against the row layout's loop, one
// activation row, Zen 3 (AVX2), weights streamed from memory: 1 thread 1.2-1.3x (its loop ran at the
// memory rate only from L3: 1.55x there), 2 threads 1.5-2.0x on the MLP and the head (46 GB/s on the
// head, where a plain 2-thread sum reads ~40); docs/performance.md.
// The last N % 8 rows stay in rows after the tiles (at the offsets the row layout gives them).
struct Int4Weights {
  const uint8_t* codes;
  const uint16_t* scales;
  const uint8_t* zeros;
  int64_t N, K, G;
  bool tiles8;
  int64_t groups() const { return K / G; }
  int64_t tiled_rows() const { return tiles8 ? N / 8 * 8 : 0; }
  bool in_tile(int64_t n) const { return n < tiled_rows(); }
  // The 4 bytes of row n's codes for k = 8w .. 8w + 7.
  const uint8_t* word(int64_t n, int64_t w) const {
    return in_tile(n) ? codes + ((n / 8 * (K / 8) + w) * 8 + n % 8) * 4 : codes + n * (K / 2) + w * 4;
  }
  int64_t group_index(int64_t n, int64_t g) const {
    return in_tile(n) ? (n / 8 * groups() + g) * 8 + n % 8 : n * groups() + g;
  }
  uint16_t scale(int64_t n, int64_t g) const { return scales[group_index(n, g)]; }
  uint8_t zero(int64_t n, int64_t g) const { return zeros[group_index(n, g)]; }
  // 32 bytes of row n's codes from byte `offset` (a multiple of 32): k = 2 offset .. 2 offset + 63.
  __m256i load32(int64_t n, int64_t offset) const {
    if (!in_tile(n)) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + n * (K / 2) + offset));
    const __m256i apart = _mm256_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56);      // a step's words are 8 apart
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(word(n, offset / 4)), apart, 4);
  }
};

// How far ahead of its reads the tiles' loop prefetches its one stream: 4 KB read 1.6x faster than
// without on the MLP's 14 MB at 2 threads, 2 KB 1.5x, 512 B 1.1x (the hardware prefetcher alone
// stops at a page).
constexpr int64_t TILES8_PREFETCH = 4096;

// y[m, 8t .. 8t + 7] for tile t and every activation row m (xq in ORDER_STEPS8, blocks of QBLOCK4).
// Per step: the 32 bytes of codes, their low and high nibbles against the step's 4 even and 4 odd
// activation codes broadcast (vpmaddubsw: a row's 4 products in two int16 lanes), 4 steps summed in
// int16 (4 x 2 x 2 x 15 x 127 < 2^15), widened by vpmaddwd: lane r holds row r's sum. Per block of 64
// one conversion and FMA by the block's scale; per group one FMA by the 8 rows' scales and one by
// their zeros x the activations' group sum. The same integers as int4_rows, the float steps per
// block instead of per lane (within 1e-5 of the float64 product, as it).
// One activation row's outputs for tile t (`prefetch`: the first row's pass, which streams the codes).
template <bool PREFETCH>
inline __m256 int4_tile8_row(const uint8_t* c, const uint16_t* s, const uint8_t* z, int64_t ng, int64_t bpg,
                             const int32_t* x, const float* dx, const float* gx) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps(), accz = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256 ag = _mm256_setzero_ps();
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      __m256i sum = _mm256_setzero_si256();
      for (int half = 0; half < 2; ++half) {
        const int64_t s0 = b * 8 + half * 4;
        __m256i p16 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const int64_t st = s0 + q;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + st * 32));
          if (PREFETCH && (q & 1) == 0) prefetch_line(c + st * 32 + TILES8_PREFETCH);
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          p16 = _mm256_add_epi16(p16, _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x[2 * st])),
                                                        _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x[2 * st + 1]))));
        }
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, ones));
      }
      ag = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(dx[b]), ag);
    }
    const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * 8)));
    const __m256 zf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + g * 8))));
    acc = _mm256_fmadd_ps(ag, sc, acc);
    accz = _mm256_fmadd_ps(_mm256_mul_ps(sc, zf), _mm256_set1_ps(gx[g]), accz);
  }
  return _mm256_sub_ps(acc, accz);
}

void int4_tiles8(const Int4Weights& w, int64_t t, const QuantizedRows& a, const float* gx, int64_t M, float* y,
                 int64_t ldy) {
  const int64_t K = w.K, ng = w.groups(), nb = K / QBLOCK4, bpg = w.G / QBLOCK4;
  const uint8_t* c = w.codes + t * 8 * (K / 2);
  const uint16_t* s = w.scales + t * 8 * ng;
  const uint8_t* z = w.zeros + t * 8 * ng;
  for (int64_t m = 0; m < M; ++m) {
    const int32_t* x = reinterpret_cast<const int32_t*>(a.xq.data() + m * K);   // [K/8][even 4 | odd 4]
    const float* dx = a.dx.data() + m * nb;
    const __m256 out = m == 0 ? int4_tile8_row<true>(c, s, z, ng, bpg, x, dx, gx + m * ng)
                              : int4_tile8_row<false>(c, s, z, ng, bpg, x, dx, gx + m * ng);
    _mm256_storeu_ps(y + m * ldy + t * 8, out);
  }
}

template <int R>
void int8_rows(const int8_t* codes, const float* scales, int64_t n0, int64_t K, const QuantizedRows& a, int64_t M,
               float* y, int64_t ldy) {
  const int64_t nb = K / QBLOCK8;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* xq = a.xq.data() + m * K;
    const float* dx = a.dx.data() + m * nb;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * QBLOCK8));
      const __m256 d = _mm256_set1_ps(dx[b]);
      if (m == 0) prefetch_ahead<R, QBLOCK8>(reinterpret_cast<const uint8_t*>(codes + n0 * K), K, b);
      for (int r = 0; r < R; ++r) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (n0 + r) * K + b * QBLOCK8));
        // |w| (unsigned) x sign(w) * x (signed): exact in int16 (2 * 127 * 127 < 2^15)
        const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), d, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[m * ldy + n0 + r] = hsum(acc[r]) * scales[n0 + r];
  }
}

template <int R>
void fp16_rows(const uint16_t* w, int64_t n0, int64_t K, const float* x, int64_t M, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 xv = _mm256_loadu_ps(xm + k);
      if (m == 0) prefetch_ahead<R, 16>(reinterpret_cast<const uint8_t*>(w + n0 * K), 2 * K, k / 8);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + r) * K + k)));
        acc[r] = _mm256_fmadd_ps(wv, xv, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[r]);
      for (int64_t j = k; j < K; ++j) s += half_to_float(w[(n0 + r) * K + j]) * xm[j];
      y[m * ldy + n0 + r] = s;
    }
  }
}

constexpr int TILE_ROWS = 4;     // weight rows per kernel call: 4 accumulators + 4 group accumulators
constexpr int64_t CHUNK_TILES = 16;   // tiles a thread takes at a time (64 rows: 48 KB of int4 codes at K = 1536)
// Bytes of codes a thread takes at a time in tiles of 8 rows (int4_tiles8): whole tiles, 7 at K = 8960
// to 42 at K = 1536. A chunk's start is a cold stream (its prefetches not yet ahead): 48 KB chunks
// read 23.5 GB/s on the MLP's 14 MB at 2 threads where one contiguous half each read 34.7.
constexpr int64_t CHUNK_BYTES8 = 256 << 10;
// Weights smaller than this run on the calling thread alone: waking a sleeping (passive) OpenMP
// thread costs tens of microseconds, as long as one thread takes to stream this much (the dequantized
// tiles of large calls use it).
constexpr int64_t PARALLEL_MIN_BYTES = 256 << 10;
// The same for the small-call (decode) kernels, higher: with the prefetch one thread streams int4 at
// 15-19 GB/s here (a plain 1-thread sum: 16-20 GB/s, 2 threads 17-23), so a second thread can
// save little on a call of a few MB, while a fan-out cost 20-40 us per call (1.2 MB int4 q/o
// projections: 75-100 us per call on 2 threads, 50-80 us on one). At 2 MB the decoder's q/k/v/o
// (int4) run on one thread, the MLP and the head on all: 1.23x on a 2B step's int4 matmuls, 1.05x
// int8 (whose q/o, 2.4 MB, stay parallel), against 256 KB in the same run beside the test suite.
constexpr int64_t SMALL_CALL_PARALLEL_MIN_BYTES = 2 << 20;
// ... unless the helpers are awake: a helper that finished a call waits helper_spin_us for the next before it
// sleeps, where the CPU has a core for it (spin_policy). A decode step's calls follow each other within
// microseconds, so its helper then never sleeps inside a step, and a call of 256 KB pays for a second
// thread: all of a 2B step's projections and its attention on two threads (InternVL3-2B, int4, 2 threads,
// Zen 4, one process alternating: 35.2 -> 33.1 ms a step quiet).
constexpr int64_t AWAKE_PARALLEL_MIN_BYTES = 256 << 10;
std::atomic<int64_t> helper_spin_us{30};     // set_helper_spin_us; 0: helpers sleep at once

// Whether helpers may spin: only where the CPU is not oversubscribed (no more runnable threads than the
// CPUs this process may use, /proc/loadavg's count, read at most every SPIN_POLICY_MS by a caller). Beside
// busy processes a spinning helper takes the core share the calling thread or another process needs
// (one process alternating beside 2 busy ones: 52.0 ms a step sleeping, 58.1 spinning 30 us).
constexpr int64_t SPIN_POLICY_MS = 50;
std::atomic<bool> cpu_has_room{false};
std::atomic<int64_t> spin_policy_read_at{0};
// The CPUs this process may use: threads.available_cores (affinity capped by a cgroup quota), set by
// lowbit_kernels.py when it loads the library (set_cpus_available); 0 until then: helpers never spin.
std::atomic<int64_t> cpus_available{0};

// Runnable threads on the machine now (/proc/loadavg's fourth field, "running/total"), -1 where unreadable.
int64_t runnable_threads() {
  const int fd = ::open("/proc/loadavg", O_RDONLY);
  if (fd < 0) return -1;
  char buf[128];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return -1;
  buf[n] = 0;
  const char* field = buf;
  for (int spaces = 0; *field && spaces < 3; ++field) spaces += *field == ' ';
  return std::strtol(field, nullptr, 10);
}

// The helpers' spin window now, in microseconds (0: sleep at once), the policy re-read at most every SPIN_POLICY_MS.
int64_t spin_policy() {
  const int64_t spin = helper_spin_us.load(std::memory_order_relaxed);
  if (spin <= 0) return 0;
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
  int64_t last = spin_policy_read_at.load(std::memory_order_relaxed);
  if (now - last >= SPIN_POLICY_MS && spin_policy_read_at.compare_exchange_strong(last, now)) {
    const int64_t runnable = runnable_threads();
    cpu_has_room.store(runnable > 0 && runnable <= cpus_available.load(), std::memory_order_relaxed);
  }
  return cpu_has_room.load(std::memory_order_relaxed) ? spin : 0;
}

// Threads of the small-call kernels when set (> 0), else torch's (at::get_num_threads()): a decode
// step can then run torch's own small operators (norms, RoPE, attention over one row, the cache
// copy) on one thread, as lowbit.py's small_ops_on_one_thread does, and these kernels on several.
std::atomic<int64_t> small_call_threads{0};

// What callers of the row pool waited, after their own chunks, for chunks a helper had taken and not
// finished (row_pool_waits): beside busy processes a helper the scheduler puts aside while it holds a
// chunk keeps the caller waiting until it runs again; this says how much of a step that is.
std::atomic<int64_t> pool_calls{0}, pool_waits{0}, pool_wait_ns{0};

// The helpers of the small-call kernels, used instead of an OpenMP region (use_row_pool). Why our
// own: an OpenMP region ends at a barrier that waits for every thread of its team, also one that
// has not started yet; beside busy processes a woken thread can wait a scheduler slice for a core,
// and a 50 ms decode step of ~200 such calls feels it (p99/p50 1.9 beside 2 busy processes, where
// the float step's 600 ms averaged it out: docs/performance.md). Here the caller takes chunks like
// the helpers and waits only for chunks a helper has taken, never for a helper that has not woken:
// one that wakes late finds nothing left. Helpers sleep between calls (the passive policy of
// threads.py), after waiting awake helper_spin_us for the next one where the CPU has room (spin_policy).
// Which thread computes a chunk never changes its numbers.
class RowPool {
 public:
  // Run work(chunk) for chunk in [0, chunks) on the caller and up to `helpers` helper threads.
  void run(int64_t chunks, int64_t helpers, int64_t spin_us, const std::function<void(int64_t)>& work) {
    std::unique_lock<std::mutex> one_call(caller_, std::try_to_lock);
    if (!one_call || chunks > static_cast<int64_t>(FIELD)) {   // another thread's call is running: alone
      for (int64_t c = 0; c < chunks; ++c) work(c);
      return;
    }
    while (threads_ < helpers) std::thread([this, i = threads_++] { serve(i); }).detach();
    job_.store(&work, std::memory_order_relaxed);
    spin_ = spin_us;
    wanted_.store(helpers, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    gen_ = (gen_ + 1) & GEN_MASK;
    state_.store(pack(gen_, chunks, 0), std::memory_order_release);
    bool wake;
    {
      std::lock_guard<std::mutex> lock(m_);
      posted_.store(gen_, std::memory_order_release);
      wake = sleepers_ > 0;
    }
    if (wake) cv_.notify_all();
    int64_t mine = 0;
    for (int64_t c; (c = claim(gen_)) >= 0; ++mine) work(c);
    // what is left was taken by helpers that are running it: wait for them, no longer
    pool_calls.fetch_add(1, std::memory_order_relaxed);
    if (done_.load(std::memory_order_acquire) + mine < chunks) {
      const auto waited_from = std::chrono::steady_clock::now();
      for (int spins = 0; done_.load(std::memory_order_acquire) + mine < chunks; ++spins) {
        if (spins < 2000) _mm_pause(); else std::this_thread::yield();
      }
      pool_waits.fetch_add(1, std::memory_order_relaxed);
      pool_wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now() - waited_from).count(), std::memory_order_relaxed);
    }
  }

 private:
  static constexpr uint64_t BITS = 20, FIELD = (uint64_t(1) << BITS) - 1, GEN_MASK = (uint64_t(1) << 24) - 1;
  static uint64_t pack(uint64_t gen, uint64_t n, uint64_t next) { return gen << 40 | n << 20 | next; }

  // The next chunk of job `gen`, or -1. The job's size travels in the same word as the counter, so
  // a helper reading the word of a finished job never takes a chunk of the next one.
  int64_t claim(uint64_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t n = (s >> 20) & FIELD, next = s & FIELD;
      if ((s >> 40) != gen || next >= n) return -1;
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) return static_cast<int64_t>(next);
    }
  }

  void serve(int64_t index) {
    uint64_t seen = 0;
    for (;;) {
      // awake a while for the next call where the CPU has room (spin_policy), then asleep until one comes
      if (const int64_t spin = spin_; spin > 0) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin);
        while (posted_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until)
          for (int i = 0; i < 16; ++i) _mm_pause();
      }
      if (posted_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(m_);
        ++sleepers_;
        cv_.wait(lock, [&] { return posted_.load(std::memory_order_relaxed) != seen; });
        --sleepers_;
      }
      seen = posted_.load(std::memory_order_acquire);
      if (index >= wanted_.load(std::memory_order_relaxed)) continue;
      const uint64_t gen = seen;
      const std::function<void(int64_t)>* work = job_.load(std::memory_order_relaxed);
      // `work` belongs to `gen` whenever claim succeeds: the caller replaces it only after every
      // chunk of `gen` is done, and a chunk is claimed before it is done
      for (int64_t c; (c = claim(gen)) >= 0;) {
        (*work)(c);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  std::mutex caller_, m_;
  std::condition_variable cv_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0}, wanted_{0};
  std::atomic<const std::function<void(int64_t)>*> job_{nullptr};
  uint64_t gen_ = 0;
  std::atomic<uint64_t> posted_{0};
  int64_t sleepers_ = 0;     // helpers waiting on cv_ (under m_)
  std::atomic<int64_t> spin_{0};   // how long helpers wait awake after this job (run's spin_us)
  int64_t threads_ = 0;

 public:
  const pid_t pid = getpid();
};

// Never destroyed: its detached helpers wait on it until the process ends. A forked child has none
// of its parent's threads (and maybe a mutex a helper held): it starts a pool of its own.
RowPool& row_pool() {
  static std::atomic<RowPool*> pool{nullptr};
  RowPool* p = pool.load(std::memory_order_acquire);
  if (p == nullptr || p->pid != getpid()) {
    RowPool* fresh = new RowPool();
    if (!pool.compare_exchange_strong(p, fresh)) delete fresh;   // another thread got there first
    p = pool.load(std::memory_order_acquire);
  }
  return *p;
}

// Whether over_rows shares its chunks through RowPool (the default) or an OpenMP region (the
// comparison `litevlm bench --study lowbit_decode --omp` measures; use_row_pool).
std::atomic<bool> row_pool_on{true};

// Run chunk(c) for c in [0, chunks) on the small calls' team: the calling thread alone under
// SMALL_CALL_PARALLEL_MIN_BYTES of data, else small_call_threads (or torch's count), the chunks
// shared out to the calling thread and its helpers from a counter rather than in fixed halves: on a
// shared CPU a thread the scheduler has put aside leaves its chunks to the others instead of holding
// the whole call back (a fixed split waits for the slowest thread's half).
template <typename Chunk>
void on_small_call_team(int64_t chunks, int64_t bytes, Chunk chunk) {
  const int64_t own = small_call_threads.load();
  const bool pool = row_pool_on.load();
  const int64_t spin = pool ? spin_policy() : 0;
  const int64_t min_bytes = spin > 0 ? AWAKE_PARALLEL_MIN_BYTES : SMALL_CALL_PARALLEL_MIN_BYTES;
  const int64_t threads = bytes < min_bytes ? 1 : own > 0 ? own : at::get_num_threads();
  const int64_t team = std::max<int64_t>(1, std::min<int64_t>(threads, chunks));
  if (team == 1) {
    for (int64_t c = 0; c < chunks; ++c) chunk(c);
  } else if (pool) {
    row_pool().run(chunks, team - 1, spin, chunk);
  } else {
    // the same OpenMP runtime at::parallel_for uses, with the team size given here: the calling
    // thread's own torch thread count may be 1 (small_call_threads)
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(team)
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) chunk(c);
  }
}

// Run `tile` over weight rows [0, N) in tiles of TILE_ROWS (the tail one row at a time), CHUNK_TILES
// tiles a chunk on the small calls' team.
template <typename Tile, typename One>
void over_rows(int64_t N, int64_t weight_bytes, Tile tile, One one) {
  const int64_t tiles = N / TILE_ROWS, chunks = (tiles + CHUNK_TILES - 1) / CHUNK_TILES;
  on_small_call_team(chunks, weight_bytes, [&](int64_t c) {
    for (int64_t t = c * CHUNK_TILES; t < std::min(tiles, (c + 1) * CHUNK_TILES); ++t) tile(t * TILE_ROWS);
  });
  for (int64_t n = tiles * TILE_ROWS; n < N; ++n) one(n);
}

// ------------------------------------------------------------------------------ dequantization
void dequant_int4_rows(const Int4Weights& w, int64_t n0, int64_t n1, float* out) {
  const int64_t K = w.K, G = w.G, ng = w.groups();
  for (int64_t n = n0; n < n1; ++n) {
    float* o = out + (n - n0) * K;
    for (int64_t g = 0; g < ng; ++g) {
      const float s = half_to_float(w.scale(n, g));
      const float zs = -s * static_cast<float>(w.zero(n, g));
      const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(zs);
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
        // 4 bytes -> 8 codes in k order (even k low nibble)
        uint32_t packed;
        std::memcpy(&packed, w.word(n, k / 8), 4);
        const __m128i b = _mm_cvtsi32_si128(static_cast<int>(packed));
        const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
        const __m128i inter = _mm_unpacklo_epi8(lo, hi);                     // k, k+1, ... k+7
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(inter));
        _mm256_storeu_ps(o + k, _mm256_fmadd_ps(q, sv, zv));                 // (q - z) * s
      }
    }
  }
}

void dequant_int8_rows(const int8_t* codes, const float* scales, int64_t n0, int64_t n1, int64_t K, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const __m256 sv = _mm256_set1_ps(scales[n]);
    for (int64_t k = 0; k < K; k += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + n * K + k));
      _mm256_storeu_ps(out + (n - n0) * K + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sv));
    }
  }
}

void dequant_fp16_rows(const uint16_t* w, int64_t n0, int64_t n1, int64_t K, float* out) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k = 0; k < K; k += 8)
      _mm256_storeu_ps(out + (n - n0) * K + k,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * K + k))));
}

// float32 -> bfloat16 bits, rounded to nearest even as torch's .to(torch.bfloat16) rounds finite
// values (the weights are finite: quantize.py checks), 8 at a time in AVX2.
inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(src + k));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, bias), odd), 16);
    // packus interleaves the two 128-bit lanes: [r0-3 r0-3 | r4-7 r4-7] -> r0-7 in the low half
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm256_castsi256_si128(p));
  }
  for (; k < n; ++k) {
    uint32_t b;
    std::memcpy(&b, src + k, 4);
    dst[k] = static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
  }
}

// y [M, N] = x [M, K] @ W.T with W dequantized `tile` rows at a time into a reused scratch buffer
// (parallel over its rows) and multiplied by at::mm into y's columns: float32 (MKL writes the
// strided slice), or with `bf16` (`prefill_bf16`, a CPU with bfloat16 units) each row dequantized to
// float32 in L1 and rounded to bfloat16, the activations rounded to bfloat16 once, and oneDNN's
// bfloat16 GEMM (products exact, float32 accumulation, each output rounded to bfloat16 once, handed
// back in float32; its product goes to a contiguous buffer, then into y's columns): the numerics of
// `backend.weights bf16` (weights/bf16.py) over the low-bit weights. Why bfloat16: on such a CPU
// that GEMM ran 2.5-3.8x faster than the float32 one at a 2B model's prefill shapes (256 rows, 2
// threads, Zen 4), which pays for the dequantization and more, where the float32 tiles left
// low-bit prefill 1.1-1.4x slower than float's.
template <typename Dequant>
at::Tensor tiled_gemm(const at::Tensor& x, int64_t N, int64_t K, int64_t tile, bool bf16, Dequant dequant) {
  const int64_t M = x.size(0);
  const at::Tensor xg = bf16 ? x.to(at::kBFloat16) : x;          // the GEMM's input
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor scratch = at::empty({std::min(tile, N), K}, xg.options());
  // (a tile smaller than PARALLEL_MIN_BYTES is dequantized by the calling thread alone)
  const int64_t grain = std::max<int64_t>(8, PARALLEL_MIN_BYTES / (K * scratch.element_size()));
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t n1 = std::min(N, n0 + tile);
    at::parallel_for(n0, n1, grain, [&](int64_t b, int64_t e) {
      if (!bf16) {
        dequant(b, e, scratch.data_ptr<float>() + (b - n0) * K);
        return;
      }
      uint16_t* s = reinterpret_cast<uint16_t*>(scratch.data_ptr<at::BFloat16>());
      std::vector<float> row(K);
      for (int64_t n = b; n < e; ++n) {
        dequant(n, n + 1, row.data());
        to_bf16(row.data(), s + (n - n0) * K, K);
      }
    });
    const at::Tensor w = scratch.narrow(0, 0, n1 - n0);
    at::Tensor out = y.narrow(1, n0, n1 - n0);
    if (bf16)
      out.copy_(at::mm(xg, w.t()));
    else
      at::mm_out(out, xg, w.t());
  }
  return y;
}

// ------------------------------------------------------------------------------ int8 prefill GEMM
// Large calls of the int4 and int8 forms with `prefill_int8` (AVX-512 VNNI; AVX2 below): the
// activations quantized to int8 per block of KB = 128 elements (64 where the weight's group or K
// asks; scale max|x| / 127, the rounding of quantize_activations), multiplied by the int8 weights
// (int4: q - zero, in [-15, 15]; int8: the codes) with vpdpbusd, int32 sums per block, float32
// across blocks: y[m, n] = sum_b dx[m, b] * s[n, b] * sum_{k in b} xq[m, k] * w[n, k], exact in
// int32 within a block. The same scheme as the small-call kernels (llama.cpp's Q8_0 activations),
// as a register-tiled GEMM.
// Why our own: on a CPU with VNNI, int8 products run at twice the rate of bfloat16 ones (Zen 4:
// torch._int_mm 2.0x oneDNN's bfloat16 matmul per CPU-second at 512 x 1536 x 4480), and the
// weights' per-group scales need a float step per block that no library GEMM torch ships offers
// (torch._int_mm has one int32 sum over all of K; oneDNN's grouped-scale int8 matmul is not
// reachable through torch); it also skips the dequantized tiles' pass over every weight.
// Layout: vpdpbusd multiplies unsigned by signed bytes, four at a time into an int32 lane. The
// activations are the unsigned side, xq + 128 (in [1, 255]), packed per block of 32 rows as
// [M'/32][K/4][32][4], so that one 64-byte load holds 4 consecutive k of 16 rows and a micro-tile
// reads its rows' activations as one sequential stream; the weights are the signed side, 4 bytes of
// one row broadcast to every lane. sum (xq + 128) w = sum xq w + 128 sum w: each block's sum starts
// at -128 * sum w (the weights' block sums). A micro-tile is VNNI_R weight rows x 32 activation
// rows (2 x R int32 and 2 x R float32 accumulators in registers). int4 codes are unpacked per
// panel of VNNI_R rows into int8 (low nibbles, then high ones, per block: the activations are
// quantized in that order, int4_order), kept in L1/L2 while every activation row of an L2-sized
// chunk passes over them.
constexpr int VNNI_R = 6;                    // weight rows per micro-tile (12 + 12 accumulators)
constexpr int64_t VNNI_MB = 32;              // activation rows per micro-tile (two 16-lane registers)
constexpr int64_t VNNI_CHUNK_BYTES = 4 << 20;  // activation bytes an m-chunk reads per panel (L2/L3)

struct VnniActivations {
  std::vector<uint8_t> xu;     // [m_pad/32][K/4][32][4]: xq + 128 (offset), else xq (the AVX2 int8 tiles)
  std::vector<float> dxt;      // [m_pad/32][K/KB][32]: block scales (0 for padded rows)
  int64_t m_pad = 0;
};

VnniActivations vnni_activations(const at::Tensor& x, const c10::optional<at::Tensor>& pqs, int64_t KB,
                                 bool int4_order, bool offset) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / KB;
  VnniActivations a;
  a.m_pad = (M + VNNI_MB - 1) / VNNI_MB * VNNI_MB;
  const uint32_t flip = offset ? 0x80808080u : 0u;       // + 128, byte by byte
  a.xu.assign(static_cast<size_t>(K * a.m_pad), static_cast<uint8_t>(flip));   // padded rows: code 0
  a.dxt.assign(static_cast<size_t>(nb * a.m_pad), 0.f);
  const float* xp = x.data_ptr<float>();
  const float* pp = pqs ? pqs->data_ptr<float>() : nullptr;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<int8_t> xq(K);
    std::vector<float> dx(nb);
    std::vector<int32_t> bsum(nb);
    for (int64_t m = m0; m < m1; ++m) {
      quantize_activations(xp + m * K, pp, 1, K, static_cast<int>(KB), int4_order, xq.data(), dx.data(), bsum.data());
      for (int64_t q = 0; q < K / 4; ++q) {
        uint32_t w;
        std::memcpy(&w, xq.data() + q * 4, 4);
        w ^= flip;
        std::memcpy(a.xu.data() + (((m / VNNI_MB) * (K / 4) + q) * VNNI_MB + m % VNNI_MB) * 4, &w, 4);
      }
      for (int64_t b = 0; b < nb; ++b) a.dxt[((m / VNNI_MB) * nb + b) * VNNI_MB + m % VNNI_MB] = dx[b];
    }
  });
  return a;
}

// One panel of up to VNNI_R weight rows as the GEMM reads them: int8 rows [R][K] (in the
// activations' k order), per row and block the scale s[n, b] and the sum of its int8 weights.
struct VnniPanel {
  std::vector<int8_t> w;
  std::vector<float> scale;     // [R][nb]
  std::vector<int32_t> bias;    // [R][nb]: -128 * sum of the block's weights
  const int8_t* rows[VNNI_R];
};

LITEVLM_AVX512 inline int32_t sum_s8(const int8_t* p, int64_t n) {   // n a multiple of 32
  __m512i acc = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 64) {   // sum (w + 128) by vpsadbw, then less 128 per byte
    const __mmask64 m = n - i >= 64 ? ~__mmask64(0) : (__mmask64(1) << (n - i)) - 1;
    acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_maskz_mov_epi8(m, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, p + i), flip)), zero));
  }
  return static_cast<int32_t>(_mm512_reduce_add_epi64(acc) - 128 * n);
}

// int8 rows n0 .. n0 + r: read in place (natural k order); the scale is the row's for every block;
// no bias (the AVX2 int8 tiles' activations carry no + 128).
void panel_int8(const int8_t* codes, const float* scales, int64_t n0, int r, int64_t K, int64_t KB, VnniPanel& p) {
  const int64_t nb = K / KB;
  for (int i = 0; i < r; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      p.scale[i * nb + b] = scales[n0 + i];
      p.bias[i * nb + b] = 0;
    }
    p.rows[i] = codes + (n0 + i) * K;
  }
}

// panel_int8 for the VNNI tiles, whose activations are xq + 128: each block's bias -128 * sum of its weights.
LITEVLM_AVX512 void vnni_panel_int8(const int8_t* codes, const float* scales, int64_t n0, int r, int64_t K, int64_t KB,
                                    VnniPanel& p) {
  panel_int8(codes, scales, n0, r, K, KB, p);
  const int64_t nb = K / KB;
  for (int i = 0; i < r; ++i)
    for (int64_t b = 0; b < nb; ++b) p.bias[i * nb + b] = -128 * sum_s8(p.rows[i] + b * KB, KB);
}

// acc += the products of unsigned bytes u and signed bytes w, four per int32 lane (vpdpbusd), as
// an asm statement: g++ 12 compiled the intrinsic in this loop with two register copies per
// instruction (the accumulator moved out and back), an asm operand that is read and written ("+v")
// stays in its register.
LITEVLM_AVX512 inline void dpbusd(__m512i& acc, __m512i u, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(w));
}

// y[m0 .. m0+32, n0 .. n0+R] for one panel: out[R][32] (row-major by weight row).
template <int R>
LITEVLM_AVX512 void vnni_tile(const VnniPanel& p, int64_t nb, int64_t KB, const VnniActivations& a, int64_t m0,
                              float* out) {
  __m512 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  const uint8_t* x = a.xu.data() + m0 * nb * KB;              // this block of 32 rows: [K/4][32][4]
  const float* dx = a.dxt.data() + m0 * nb;                   // [nb][32]
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_set1_epi32(p.bias[r * nb + b]);
    const int8_t* w[R];
    for (int r = 0; r < R; ++r) w[r] = p.rows[r] + b * KB;
#pragma GCC unroll 4
    for (int64_t q = 0; q < KB / 4; ++q, x += VNNI_MB * 4) {
      const __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + 64);
      for (int r = 0; r < R; ++r) {
        int32_t wq;
        std::memcpy(&wq, w[r] + q * 4, 4);
        const __m512i wv = _mm512_set1_epi32(wq);
        dpbusd(acc[r][0], x0, wv);
        dpbusd(acc[r][1], x1, wv);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(dx + b * VNNI_MB), d1 = _mm512_loadu_ps(dx + b * VNNI_MB + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(p.scale[r * nb + b]);
      f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(d0, s), f[r][0]);
      f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(d1, s), f[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * VNNI_MB, f[r][0]);
    _mm512_storeu_ps(out + r * VNNI_MB + 16, f[r][1]);
  }
}

template <int R>
void vnni_tiles(const VnniPanel& p, int64_t nb, int64_t KB, const VnniActivations& a, int64_t m0, int64_t m1,
                int64_t M, int64_t n0, float* y, int64_t N) {
  alignas(64) float out[R * VNNI_MB];
  for (int64_t m = m0; m < m1; m += VNNI_MB) {
    vnni_tile<R>(p, nb, KB, a, m, out);
    for (int64_t i = 0; i < std::min(VNNI_MB, M - m); ++i)
      for (int r = 0; r < R; ++r) y[(m + i) * N + n0 + r] = out[r * VNNI_MB + i];
  }
}

// The same GEMM on CPUs with AVX2 but no VNNI (Zen 2/3, Haswell to Comet Lake): each vpdpbusd as
// vpmaddubsw (two products of unsigned by signed bytes, summed into int16) + vpmaddwd by ones (two
// int16 into int32) + vpaddd: the same int32 sums, so the same outputs bit for bit. The int16 pair
// must not saturate: int4 panels (q - zero in [-15, 15]) take the activations as they are, xq + 128
// (a pair at most 2 x 255 x 15 < 2^15); int8 weights would saturate there (2 x 255 x 127), so they
// take llama.cpp's sign trick instead: |w| as the unsigned side, xq with w's sign as the signed one
// (vpsignb; a pair at most 2 x 128 x 127 < 2^15), no + 128 and no bias. A micro-tile is
// AVX2_GEMM_R rows of the panel x 16 activation rows (half of a 32-row block: 3 x 2 int32
// accumulators, 2 activation registers, the broadcast weights and the ones in 16 registers).
// Measured at a 2B decoder's shapes, a 256-row prompt's matmuls, 2 threads, Zen 3 (`litevlm bench
// --study lowbit_kernels --rows 256`): int4 2.34x float32's (the dequantized tiles 0.98x; OpenVINO's
// u4 matmul with int8 dynamic quantization 1.22x), int8 by the sign trick 1.52x; at the vision
// tower's shapes (int8, 1,025 rows) 1.1-1.3x (the sign trick's extra steps).
constexpr int AVX2_GEMM_R = 3;
static_assert(VNNI_R % AVX2_GEMM_R == 0, "a panel is whole micro-tiles");

// int4 rows n0 .. n0 + r for both micro-tiles: codes (k even: low nibble) -> int8 q - zero, per block
// [low nibbles | high nibbles] (KB = 64 or 128: 32 or 64 bytes of codes), in AVX2 (once per panel:
// cheap beside its GEMM).
void panel_int4(const Int4Weights& w, int64_t n0, int r, int64_t KB, VnniPanel& p) {
  const int64_t K = w.K, G = w.G, nb = K / KB;
  const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  for (int i = 0; i < r; ++i) {
    const int64_t n = n0 + i;
    int8_t* out = p.w.data() + i * K;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t g = b * KB / G;
      const __m256i z = _mm256_set1_epi8(static_cast<char>(w.zero(n, g)));
      __m256i qsum = zero;
      for (int64_t c = 0; c < KB / 2; c += 32) {
        const __m256i v = w.load32(n, b * KB / 2 + c);
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        qsum = _mm256_add_epi64(qsum, _mm256_sad_epu8(_mm256_add_epi8(lo, hi), zero));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * KB + c), _mm256_sub_epi8(lo, z));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * KB + KB / 2 + c), _mm256_sub_epi8(hi, z));
      }
      alignas(32) int64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), qsum);
      const int64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
      p.scale[i * nb + b] = half_to_float(w.scale(n, g));
      p.bias[i * nb + b] = -128 * static_cast<int32_t>(sum - KB * static_cast<int64_t>(w.zero(n, g)));
    }
    p.rows[i] = out;
  }
}

// out[r0 + r][h * 16 .. h * 16 + 16] for R panel rows from r0 and the half h of the 32-row block at
// m0; SIGNED: int8 weights (the sign trick).
template <int R, bool SIGNED>
void avx2_tile(const VnniPanel& p, int r0, int64_t nb, int64_t KB, const VnniActivations& a, int64_t m0, int h,
               float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* x = a.xu.data() + m0 * nb * KB + h * 64;       // [K/4][32][4]: this half's 16 rows
  const float* dx = a.dxt.data() + m0 * nb + h * 16;          // [nb][32]
  __m256 f[R][2];
  for (int r = 0; r < R; ++r) f[r][0] = f[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_set1_epi32(p.bias[(r0 + r) * nb + b]);
    const int8_t* w[R];
    for (int r = 0; r < R; ++r) w[r] = p.rows[r0 + r] + b * KB;
    if (!SIGNED) {
      // int4: two steps' pairs summed in int16 before vpmaddwd (4 x 255 x 15 < 2^15): 3 multiplies
      // per 64 products of a register, not 4 (1.08-1.15x alone). KB / 4 steps is even (KB >= 64).
#pragma GCC unroll 2
      for (int64_t q = 0; q < KB / 4; q += 2, x += 2 * VNNI_MB * 4) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
        const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + VNNI_MB * 4));
        const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + VNNI_MB * 4 + 32));
        for (int r = 0; r < R; ++r) {
          int32_t wq[2];
          std::memcpy(wq, w[r] + q * 4, 8);
          const __m256i wa = _mm256_set1_epi32(wq[0]), wb = _mm256_set1_epi32(wq[1]);
          const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(x0, wa), _mm256_maddubs_epi16(y0, wb));
          const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(x1, wa), _mm256_maddubs_epi16(y1, wb));
          acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
          acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
        }
      }
    } else {   // int8: the sign trick, one step at a time (a pair can reach 2 x 128 x 127)
#pragma GCC unroll 4
      for (int64_t q = 0; q < KB / 4; ++q, x += VNNI_MB * 4) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));   // xq (no offset)
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
        for (int r = 0; r < R; ++r) {
          int32_t wq;
          std::memcpy(&wq, w[r] + q * 4, 4);
          const __m256i wv = _mm256_set1_epi32(wq);
          const __m256i aw = _mm256_abs_epi8(wv);
          const __m256i p0 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x0, wv));
          const __m256i p1 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x1, wv));
          acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
          acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
        }
      }
    }
    const __m256 d0 = _mm256_loadu_ps(dx + b * VNNI_MB), d1 = _mm256_loadu_ps(dx + b * VNNI_MB + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(p.scale[(r0 + r) * nb + b]);
      f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), _mm256_mul_ps(d0, s), f[r][0]);
      f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), _mm256_mul_ps(d1, s), f[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + (r0 + r) * VNNI_MB + h * 16, f[r][0]);
    _mm256_storeu_ps(out + (r0 + r) * VNNI_MB + h * 16 + 8, f[r][1]);
  }
}

// vnni_tiles' work for a panel of `rows` rows in AVX2 micro-tiles.
template <bool SIGNED>
void avx2_tiles(const VnniPanel& p, int rows, int64_t nb, int64_t KB, const VnniActivations& a, int64_t m0, int64_t m1,
                int64_t M, int64_t n0, float* y, int64_t N) {
  alignas(64) float out[VNNI_R * VNNI_MB];
  for (int64_t m = m0; m < m1; m += VNNI_MB) {
    for (int h = 0; h < 2; ++h)
      for (int r0 = 0; r0 < rows; r0 += AVX2_GEMM_R)
        switch (std::min(AVX2_GEMM_R, rows - r0)) {
          case 3: avx2_tile<3, SIGNED>(p, r0, nb, KB, a, m, h, out); break;
          case 2: avx2_tile<2, SIGNED>(p, r0, nb, KB, a, m, h, out); break;
          default: avx2_tile<1, SIGNED>(p, r0, nb, KB, a, m, h, out); break;
        }
    for (int64_t i = 0; i < std::min(VNNI_MB, M - m); ++i)
      for (int r = 0; r < rows; ++r) y[(m + i) * N + n0 + r] = out[r * VNNI_MB + i];
  }
}

// y [M, N] = the int8 product of x [M, K] and the panels `prepare` writes (prepare(n0, rows, panel)),
// on the AVX-512 VNNI micro-tiles (avx512) or the AVX2 ones.
template <typename Prepare>
at::Tensor vnni_gemm(const at::Tensor& x, const c10::optional<at::Tensor>& pqs, int64_t N, int64_t KB, bool int4_order,
                     bool avx512, Prepare prepare) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / KB;
  const bool sign_trick = !avx512 && !int4_order;    // AVX2 tiles over int8 panels (int4 ones come in int4 order)
  const VnniActivations a = vnni_activations(x, pqs, KB, int4_order, !sign_trick);
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t panels = (N + VNNI_R - 1) / VNNI_R;
  const int64_t chunk = std::max<int64_t>(VNNI_MB, VNNI_CHUNK_BYTES / K / VNNI_MB * VNNI_MB);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    VnniPanel p;
    p.w.resize(VNNI_R * K);
    p.scale.resize(VNNI_R * nb);
    p.bias.resize(VNNI_R * nb);
    for (int64_t m0 = 0; m0 < a.m_pad; m0 += chunk) {
      const int64_t m1 = std::min(a.m_pad, m0 + chunk);
      for (int64_t pi = p0; pi < p1; ++pi) {
        const int64_t n0 = pi * VNNI_R;
        const int r = static_cast<int>(std::min<int64_t>(VNNI_R, N - n0));
        prepare(n0, r, p);
        if (!avx512) {
          if (sign_trick)
            avx2_tiles<true>(p, r, nb, KB, a, m0, m1, M, n0, yp, N);
          else
            avx2_tiles<false>(p, r, nb, KB, a, m0, m1, M, n0, yp, N);
          continue;
        }
        switch (r) {
          case 6: vnni_tiles<6>(p, nb, KB, a, m0, m1, M, n0, yp, N); break;
          case 5: vnni_tiles<5>(p, nb, KB, a, m0, m1, M, n0, yp, N); break;
          case 4: vnni_tiles<4>(p, nb, KB, a, m0, m1, M, n0, yp, N); break;
          case 3: vnni_tiles<3>(p, nb, KB, a, m0, m1, M, n0, yp, N); break;
          case 2: vnni_tiles<2>(p, nb, KB, a, m0, m1, M, n0, yp, N); break;
          default: vnni_tiles<1>(p, nb, KB, a, m0, m1, M, n0, yp, N); break;
        }
      }
    }
  });
  return y;
}

// The int8 GEMM's block for K (and an int4 group G, 0 for int8): 128 where it divides both, else 64, else 32.
int64_t vnni_block(int64_t K, int64_t G) {
  for (int64_t kb : {128, 64, 32})
    if (K % kb == 0 && (G == 0 || G % kb == 0)) return kb;
  return 0;
}

// ------------------------------------------------------------------------------ few-row attention
// A decode step's attention (models/decoder.attend_few_rows): the rows of one call, q [T, Hq, D],
// over a layer's cache that already holds them, k, v [Hkv, S, D] (unit stride over D; any stride
// over S: the arena's slice), under allowed [T, S], in float32 with AVX2 + FMA. Per KV head (one
// chunk each, shared out by the row pool like the small calls): the scores of its group x T query
// rows, each key row loaded once for all of them; an exact softmax per row (its maximum, then
// exp(s - max) by exp_avx2 (simd_avx2.h), the sum); then p.v as a GEMM micro-kernel of 6 rows x 16
// columns (each value row read once per 16 columns, one cache line, so V is read once in all).
// Why our own: through torch (two grouped matmuls and a softmax, or its CPU flash kernel) a decode
// step's attention took ~160 us a layer over 256 cached rows and ~460 over 1,780 at a 2B decoder's
// heads on one thread: per-call overhead at small S, ~8 GB/s of the cache at large S.
constexpr int FEW_ROW_BLOCK = 6;     // query rows per micro-kernel (6 x 2 accumulators + 2 loads + 1 broadcast)

// scores[r * S + j] = scale * q_r . k_j for ROWS (<= FEW_ROW_BLOCK) query rows q_r (D floats each). ROWS a
// template parameter: the accumulators then stay in registers (with a run-time count they lived on the stack,
// a load and a store around every FMA).
template <int ROWS>
void few_row_scores(const float* const* q, const float* k, int64_t k_stride, int64_t S, int64_t D, float scale,
                    float* scores) {
  for (int64_t j = 0; j < S; ++j) {
    const float* kj = k + j * k_stride;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = _mm256_loadu_ps(kj + d);
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), kv, acc[r]);
    }
    for (int r = 0; r < ROWS; ++r) scores[r * S + j] = hsum(acc[r]) * scale;
  }
}

// One row's scores -> probabilities in place: masked columns 0, the others exp(s - max) / sum.
void few_row_softmax(float* s, const bool* allowed, int64_t S) {
  float m = -INFINITY;
  for (int64_t j = 0; j < S; ++j)
    if (allowed[j]) m = std::max(m, s[j]);
  __m256 sum = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  int64_t j = 0;
  for (; j + 8 <= S; j += 8) {
    __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    alignas(32) float keep[8];
    for (int i = 0; i < 8; ++i) keep[i] = allowed[j + i] ? 1.f : 0.f;
    e = _mm256_mul_ps(e, _mm256_load_ps(keep));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  for (; j < S; ++j) {
    s[j] = allowed[j] ? std::exp(s[j] - m) : 0.f;
    total += s[j];
  }
  const __m256 inv = _mm256_set1_ps(1.f / total);
  for (j = 0; j + 8 <= S; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
  for (; j < S; ++j) s[j] /= total;
}

// out_r[c0 .. c0 + 16) = sum_j p[r * S + j] v_j[c0 ..] for ROWS (<= FEW_ROW_BLOCK) rows.
template <int ROWS>
void few_row_values(const float* p, const float* v, int64_t v_stride, int64_t S, int64_t c0, float* const* out) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < S; ++j) {
    const float* vj = v + j * v_stride + c0;
    const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * S + j);
      acc[r][0] = _mm256_fmadd_ps(pr, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pr, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_ps(out[r] + c0, acc[r][0]);
    _mm256_storeu_ps(out[r] + c0 + 8, acc[r][1]);
  }
}

// One block of `rows` (<= FEW_ROW_BLOCK) query rows: scores, softmax per row (its mask row: masks[i]), p.v.
template <int ROWS>
void few_row_block(const float* const* q, const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                   int64_t S, int64_t D, float scale, const bool* const* masks, float* scores, float* const* out) {
  few_row_scores<ROWS>(q, k, k_stride, S, D, scale, scores);
  for (int i = 0; i < ROWS; ++i) few_row_softmax(scores + i * S, masks[i], S);
  for (int64_t c0 = 0; c0 < D; c0 += 16) few_row_values<ROWS>(scores, v, v_stride, S, c0, out);
}

using FewRowBlock = void (*)(const float* const*, const float*, int64_t, const float*, int64_t, int64_t, int64_t, float,
                             const bool* const*, float*, float* const*);
constexpr FewRowBlock FEW_ROW_BLOCKS[FEW_ROW_BLOCK + 1] = {nullptr, few_row_block<1>, few_row_block<2>,
                                                           few_row_block<3>, few_row_block<4>, few_row_block<5>,
                                                           few_row_block<6>};

}  // namespace

at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                          double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && allowed.dim() == 2, "attention_rows: q [T, Hq, D], "
              "k, v [Hkv, S, D], allowed [T, S]; got ", q.sizes(), k.sizes(), v.sizes(), allowed.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              allowed.scalar_type() == at::kBool, "attention_rows: float32 q, k, v and a bool mask");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(D % 16 == 0 && Hq % Hkv == 0 && k.size(2) == D && v.size(0) == Hkv && v.size(1) == S && v.size(2) == D &&
              allowed.size(0) == T && allowed.size(1) == S && k.stride(2) == 1 && v.stride(2) == 1 && S > 0,
              "attention_rows: shapes ", q.sizes(), k.sizes(), v.sizes(), allowed.sizes(), " (D a multiple of 16, "
              "unit stride over D)");
  const at::Tensor qc = q.contiguous(), mask = allowed.contiguous();
  at::Tensor out = at::empty({T, Hq * D}, q.options());
  const int64_t group = Hq / Hkv, rows = group * T;
  std::vector<float> scores(Hkv * rows * S);
  const float* qp = qc.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  auto head = [&](int64_t h) {
    const float* kh = k.data_ptr<float>() + h * k.stride(0);
    const float* vh = v.data_ptr<float>() + h * v.stride(0);
    float* sh = scores.data() + h * rows * S;
    for (int64_t r0 = 0; r0 < rows; r0 += FEW_ROW_BLOCK) {     // row r: query row t = r / group, head h * group + r % group
      const int n = static_cast<int>(std::min<int64_t>(FEW_ROW_BLOCK, rows - r0));
      const float* qr[FEW_ROW_BLOCK];
      float* orow[FEW_ROW_BLOCK];
      const bool* masks[FEW_ROW_BLOCK];
      for (int i = 0; i < n; ++i) {
        const int64_t r = r0 + i, t = r / group, hq = h * group + r % group;
        qr[i] = qp + (t * Hq + hq) * D;
        orow[i] = op + t * Hq * D + hq * D;
        masks[i] = mp + t * S;
      }
      FEW_ROW_BLOCKS[n](qr, kh, k.stride(1), vh, v.stride(1), S, D, static_cast<float>(scale), masks, sh + r0 * S, orow);
    }
  };
  // One chunk per KV head; more than one thread only where the cache (K and V) pays for a wake-up.
  on_small_call_team(Hkv, Hkv * S * D * 8, head);
  return out;
}

namespace {

// ------------------------------------------------------------------------------ bfloat16 attention
// Attention over many rows (a vision tile's 1,025 tokens, a prompt) on a CPU with AVX-512 BF16:
// q, k and v rounded to bfloat16, the scores q.k in float32 (vdpbf16ps: exact products, float32
// sums), an online softmax in float32 (flash attention: per block of ATT_KEYS keys the running
// maximum, the rescaled sum and output), the probabilities rounded to bfloat16 for p.v, float32
// sums. Why our own: torch's CPU scaled_dot_product_attention runs its blocks through MKL's float32
// GEMM (on AMD its AVX2 path) and its bfloat16 path was no faster here (InternViT's 1,025 x 1,025 x
// 16 heads, Zen 4); oneDNN's bfloat16 matmul, as torch exposes it, rounds the scores to bfloat16
// (their error then grows with their size: 0.25 at a score of 50, before the exponential), and the
// bfloat16 -> float32 GEMM torch has inside (cpublas) is not exported.
// Layout: K and V of each (batch, KV head) are packed once into bfloat16 pairs, K as
// [key block][D/2][ATT_KEYS][2] (a 64-byte load: 16 keys x one pair of d) and V as
// [key block][ATT_KEYS/2][D][2] (16 d x one pair of keys); a tile is ATT_ROWS query rows, their q
// pairs broadcast. Masks: none, or causal with an offset (query i sees keys j <= i + offset: a prompt
// after `offset` cached columns, all visible); key blocks wholly past a tile's last row are skipped.
#define LITEVLM_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

constexpr int ATT_ROWS = 4;       // query rows per tile
constexpr int ATT_KEYS = 128;     // keys per block (the scores in two halves of 4 registers of 16)

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
const bool has_avx512_bf16 = cpu_has_avx512_bf16();

// float32 -> bfloat16 bits, round to nearest even (finite values), as torch rounds.
inline uint16_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// acc += a . b per float32 lane over its two bfloat16 pairs (vdpbf16ps; an asm statement for the
// reason dpbusd is one).
LITEVLM_BF16 inline void dpbf16(__m512& acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// exp(x) for x <= 0 (Cephes' expf: 2^n e^r, r in [-ln2/2, ln2/2], a degree-5 polynomial; ~1 ulp);
// below -87 the result is under float32's normal range and flushes towards 0.
LITEVLM_BF16 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// One (batch, KV head)'s K and V [S, D] (any strides) packed as the kernel reads them, S padded to
// whole blocks with zeros.
void pack_kv(const at::TensorAccessor<float, 2>& k, const at::TensorAccessor<float, 2>& v, int64_t S, int64_t D,
             uint16_t* kp, uint16_t* vp) {
  const int64_t blocks = (S + ATT_KEYS - 1) / ATT_KEYS;
  std::memset(kp, 0, blocks * ATT_KEYS * D * 2);
  std::memset(vp, 0, blocks * ATT_KEYS * D * 2);
  for (int64_t j = 0; j < S; ++j) {
    const int64_t b = j / ATT_KEYS, jj = j % ATT_KEYS;
    uint16_t* kb = kp + b * ATT_KEYS * D;
    uint16_t* vb = vp + b * ATT_KEYS * D;
    for (int64_t d = 0; d < D; ++d) {
      kb[((d / 2) * ATT_KEYS + jj) * 2 + d % 2] = bf16_bits(k[j][d]);
      vb[((jj / 2) * D + d) * 2 + jj % 2] = bf16_bits(v[j][d]);
    }
  }
}

// acc[r][c] += pairs[r] . the c-th of the 4 registers at p, for every row r: one bfloat16 pair of each
// row broadcast against 4 x 16 lanes of packed pairs (keys for the scores, d for p.v).
LITEVLM_BF16 __attribute__((always_inline)) inline void dp_rows(__m512 (&acc)[ATT_ROWS][4],
                                                                const uint32_t (&pairs)[ATT_ROWS], const uint16_t* p) {
  const __m512i b0 = _mm512_loadu_si512(p), b1 = _mm512_loadu_si512(p + 32), b2 = _mm512_loadu_si512(p + 64),
                b3 = _mm512_loadu_si512(p + 96);
#pragma GCC unroll 4
  for (int r = 0; r < ATT_ROWS; ++r) {
    const __m512i a = _mm512_set1_epi32(static_cast<int>(pairs[r]));
    dpbf16(acc[r][0], a, b0);
    dpbf16(acc[r][1], a, b1);
    dpbf16(acc[r][2], a, b2);
    dpbf16(acc[r][3], a, b3);
  }
}

// The scores of ATT_ROWS query rows (their bfloat16 pairs) against one block of packed keys: sc
// [ATT_ROWS][ATT_KEYS], 64 keys (half of a block: `half`) at a time. A function of its own so that
// its 16 accumulators stay in registers (inside attention_tile g++ 12 kept them on the stack, a load
// and a store around every vdpbf16ps).
LITEVLM_BF16 __attribute__((noinline)) void qk_block(const uint32_t (*qpair)[128], const uint16_t* kb, int64_t D,
                                                     int half, float (*sc)[ATT_KEYS]) {
  __m512 s[ATT_ROWS][4];
#pragma GCC unroll 4
  for (int r = 0; r < ATT_ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
  for (int64_t pr = 0; pr < D / 2; ++pr) {
    uint32_t pairs[ATT_ROWS];
    for (int r = 0; r < ATT_ROWS; ++r) pairs[r] = qpair[r][pr];
    dp_rows(s, pairs, kb + pr * ATT_KEYS * 2 + half * 128);
  }
#pragma GCC unroll 4
  for (int r = 0; r < ATT_ROWS; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_store_ps(&sc[r][half * 64 + c * 16], s[r][c]);
}

// o [ATT_ROWS][D] += p [ATT_ROWS][ATT_KEYS] (bfloat16) . one block of packed values, 64 d at a time.
LITEVLM_BF16 __attribute__((noinline)) void pv_block(const uint16_t (*p16)[ATT_KEYS], const uint16_t* vb, int64_t D,
                                                     float (*o)[256]) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 acc[ATT_ROWS][4];
#pragma GCC unroll 4
    for (int r = 0; r < ATT_ROWS; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_load_ps(&o[r][d0 + c * 16]);
    for (int64_t pr = 0; pr < ATT_KEYS / 2; ++pr) {
      uint32_t pairs[ATT_ROWS];
      for (int r = 0; r < ATT_ROWS; ++r) std::memcpy(&pairs[r], &p16[r][pr * 2], 4);
      dp_rows(acc, pairs, vb + (pr * D + d0) * 2);
    }
#pragma GCC unroll 4
    for (int r = 0; r < ATT_ROWS; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) _mm512_store_ps(&o[r][d0 + c * 16], acc[r][c]);
  }
}

// Rows q0 .. q0 + rows of one query head against its packed K/V: out [rows][D] (float32, strided).
LITEVLM_BF16 void attention_tile(const at::TensorAccessor<float, 2>& q, int64_t q0, int rows, int64_t S, int64_t D,
                                 const uint16_t* kp, const uint16_t* vp, float scale, int64_t offset,
                                 at::TensorAccessor<float, 2> out) {
  alignas(64) uint32_t qpair[ATT_ROWS][128];         // D <= 256
  alignas(64) uint16_t p16[ATT_ROWS][ATT_KEYS];
  alignas(64) float sc[ATT_ROWS][ATT_KEYS];
  alignas(64) float o[ATT_ROWS][256];
  float m[ATT_ROWS], l[ATT_ROWS];
  for (int r = 0; r < ATT_ROWS; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    for (int64_t d = 0; d < D; ++d) o[r][d] = 0.f;
    for (int64_t d = 0; d < D; d += 2) {
      const int64_t qr = q0 + std::min(r, rows - 1);          // a short tile repeats its last row
      qpair[r][d / 2] = bf16_bits(q[qr][d]) | (static_cast<uint32_t>(bf16_bits(q[qr][d + 1])) << 16);
    }
  }
  const int64_t last = offset < 0 ? S : std::min(S, q0 + rows - 1 + offset + 1);   // keys the tile sees
  const int64_t blocks = (last + ATT_KEYS - 1) / ATT_KEYS;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    qk_block(qpair, kp + b * ATT_KEYS * D, D, 0, sc);
    qk_block(qpair, kp + b * ATT_KEYS * D, D, 1, sc);
    // the online softmax, row by row: scaled scores, masked lanes out, the block's maximum and sum;
    // then every row's factor for what it summed before, exp(old max - new max), in one call
    constexpr int C = ATT_KEYS / 16;
    alignas(64) float m_old[16], m_new[16], bsum[16];
    for (int r = 0; r < 16; ++r) m_old[r] = m_new[r] = bsum[r] = 0.f;
    for (int r = 0; r < ATT_ROWS; ++r) {
      const int64_t limit = offset < 0 ? S : std::min(S, q0 + std::min(r, rows - 1) + offset + 1);
      __mmask16 keep[C];
      __m512 t[C];
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int c = 0; c < C; ++c) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(b * ATT_KEYS + c * 16)));
        keep[c] = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(limit)));
        t[c] = _mm512_mul_ps(_mm512_load_ps(&sc[r][c * 16]), _mm512_set1_ps(scale));
        mx = _mm512_mask_max_ps(mx, keep[c], mx, t[c]);
      }
      const float bmax = _mm512_reduce_max_ps(mx);
      if (bmax == -INFINITY) {                         // nothing visible to this row in this block
        std::memset(p16[r], 0, sizeof(p16[r]));
        continue;                                      // (alpha 1: exp(0))
      }
      const float mnew = std::max(m[r], bmax);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m512 pv = _mm512_maskz_mov_ps(keep[c], exp_nonpositive(_mm512_sub_ps(t[c], _mm512_set1_ps(mnew))));
        sum = _mm512_add_ps(sum, pv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&p16[r][c * 16]), (__m256i)_mm512_cvtneps_pbh(pv));
      }
      bsum[r] = _mm512_reduce_add_ps(sum);
      // a row that summed nothing yet (max -inf) rescales nothing: its factor is taken as exp(0)
      m_old[r] = m[r] == -INFINITY ? mnew : m[r];
      m_new[r] = m[r] = mnew;
    }
    alignas(64) float alpha[16];
    _mm512_store_ps(alpha, exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(m_old), _mm512_load_ps(m_new))));
    for (int r = 0; r < ATT_ROWS; ++r) {
      l[r] = l[r] * alpha[r] + bsum[r];
      if (alpha[r] != 1.f)
        for (int64_t d = 0; d < D; d += 16)
          _mm512_store_ps(&o[r][d], _mm512_mul_ps(_mm512_load_ps(&o[r][d]), _mm512_set1_ps(alpha[r])));
    }
    pv_block(p16, vp + b * ATT_KEYS * D, D, o);
  }
  for (int r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) out[q0 + r][d] = o[r][d] * inv;
  }
}

int64_t tile_rows(int64_t K, int64_t tile_bytes) {
  return std::max<int64_t>(16, (tile_bytes / (K * 4)) / 16 * 16);
}

void check_rows(const at::Tensor& x, int64_t K, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, what, ": x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), what, ": x must be contiguous float32");
}

}  // namespace

// ------------------------------------------------------------------------------ operators
at::Tensor int4_linear(const at::Tensor& x_, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                       const c10::optional<at::Tensor>& pqs, int64_t group_size, int64_t gemv_max_rows,
                       int64_t tile_bytes, bool prefill_bf16, bool prefill_int8, bool tiles8) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, G = group_size;
  TORCH_CHECK(G % QBLOCK4 == 0 && K % G == 0, "int4_linear: group size ", G, " must be a multiple of 64 dividing K=",
              K);
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && zeros.scalar_type() == at::kByte,
              "int4_linear: codes uint8, scales float16, zeros uint8");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(),
              "int4_linear: contiguous weights");
  const at::Tensor x = x_.contiguous();
  check_rows(x, K, "int4_linear");
  const int64_t M = x.size(0);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint8_t* z = zeros.data_ptr<uint8_t>();
  const Int4Weights w{c, s, z, N, K, G, tiles8};
  if (M > gemv_max_rows && prefill_int8) {
    const int64_t KB = vnni_block(K, G);
    return vnni_gemm(x, pqs, N, KB, true, has_avx512_vnni,
                     [&](int64_t n0, int r, VnniPanel& p) { panel_int4(w, n0, r, KB, p); });
  }
  if (M > gemv_max_rows) {
    const at::Tensor xs = pqs ? x * *pqs : x;
    return tiled_gemm(xs, N, K, tile_rows(K, tile_bytes), prefill_bf16,
                      [&](int64_t b, int64_t e, float* out) { dequant_int4_rows(w, b, e, out); });
  }
  const QuantizedRows a = quantize_rows(x, pqs, QBLOCK4, tiles8 ? ORDER_STEPS8 : ORDER_INT4);
  const std::vector<float> gx = group_sums(a, M, K, G);
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  if (tiles8) {
    const int64_t tiles = w.tiled_rows() / 8, per = std::max<int64_t>(1, CHUNK_BYTES8 / (4 * K));
    const int64_t chunks = (tiles + per - 1) / per;
    // The calling thread takes chunks from the front, its helpers from the back: two streams far apart
    // read 44 GB/s on the head at 2 threads where adjacent chunks taken in turn read 26-30 (Zen 3).
    // Each call takes one chunk, so the two ends meet exactly.
    std::atomic<int64_t> front{0}, back{chunks};
    const std::thread::id caller = std::this_thread::get_id();
    on_small_call_team(chunks, N * K / 2, [&](int64_t) {
      const int64_t ch = std::this_thread::get_id() == caller ? front.fetch_add(1) : back.fetch_sub(1) - 1;
      const int64_t t0 = ch * per, t1 = std::min(tiles, t0 + per);
      // the chunk's first TILES8_PREFETCH bytes requested at once: its loop's prefetches run that far ahead
      for (int64_t b = 0; b < std::min<int64_t>(TILES8_PREFETCH, (t1 - t0) * 4 * K); b += 64)
        prefetch_line(w.codes + t0 * 4 * K + b);
      for (int64_t t = t0; t < t1; ++t) int4_tiles8(w, t, a, gx.data(), M, yp, N);
    });
    if (w.tiled_rows() < N) {            // the rows after the last tile: the row layout's loop, its activation order
      const QuantizedRows ar = quantize_rows(x, pqs, QBLOCK4, ORDER_INT4);
      for (int64_t n = w.tiled_rows(); n < N; ++n) int4_rows<1>(c, s, z, n, K, G, ar, gx.data(), M, yp, N);
    }
  } else if (avx512_int4 && G % (2 * QBLOCK4) == 0)
    over_rows(N, N * K / 2, [&](int64_t n) { int4_rows_avx512<TILE_ROWS>(c, s, z, n, K, G, a, gx.data(), M, yp, N); },
              [&](int64_t n) { int4_rows_avx512<1>(c, s, z, n, K, G, a, gx.data(), M, yp, N); });
  else
    over_rows(N, N * K / 2, [&](int64_t n) { int4_rows<TILE_ROWS>(c, s, z, n, K, G, a, gx.data(), M, yp, N); },
              [&](int64_t n) { int4_rows<1>(c, s, z, n, K, G, a, gx.data(), M, yp, N); });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& codes, const at::Tensor& scales, int64_t gemv_max_rows,
                       int64_t tile_bytes, bool prefill_bf16, bool prefill_int8) {
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(K % QBLOCK8 == 0, "int8_linear: K=", K, " must be a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat && codes.is_contiguous(),
              "int8_linear: codes int8 contiguous, scales float32");
  const at::Tensor x = x_.contiguous();
  check_rows(x, K, "int8_linear");
  const int64_t M = x.size(0);
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  if (M > gemv_max_rows && prefill_int8) {
    const int64_t KB = vnni_block(K, 0);
    return vnni_gemm(x, c10::nullopt, N, KB, false, has_avx512_vnni, [&](int64_t n0, int r, VnniPanel& p) {
      if (has_avx512_vnni)
        vnni_panel_int8(c, s, n0, r, K, KB, p);
      else
        panel_int8(c, s, n0, r, K, KB, p);
    });
  }
  if (M > gemv_max_rows)
    return tiled_gemm(x, N, K, tile_rows(K, tile_bytes), prefill_bf16,
                      [&](int64_t b, int64_t e, float* out) { dequant_int8_rows(c, s, b, e, K, out); });
  const QuantizedRows a = quantize_rows(x, c10::nullopt, QBLOCK8, false);
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  over_rows(N, N * K, [&](int64_t n) { int8_rows<TILE_ROWS>(c, s, n, K, a, M, yp, N); },
            [&](int64_t n) { int8_rows<1>(c, s, n, K, a, M, yp, N); });
  return y;
}

at::Tensor fp16_linear(const at::Tensor& x_, const at::Tensor& weight, int64_t gemv_max_rows, int64_t tile_bytes,
                       bool prefill_bf16) {
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kHalf && weight.is_contiguous(), "fp16_linear: weight float16 contiguous");
  TORCH_CHECK(K % 8 == 0, "fp16_linear: K=", K, " must be a multiple of 8");
  const at::Tensor x = x_.contiguous();
  check_rows(x, K, "fp16_linear");
  const int64_t M = x.size(0);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::Half>());
  if (M > gemv_max_rows)
    return tiled_gemm(x, N, K, tile_rows(K, tile_bytes), prefill_bf16,
                      [&](int64_t b, int64_t e, float* out) { dequant_fp16_rows(w, b, e, K, out); });
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  over_rows(N, N * K * 2, [&](int64_t n) { fp16_rows<TILE_ROWS>(w, n, K, xp, M, yp, N); },
            [&](int64_t n) { fp16_rows<1>(w, n, K, xp, M, yp, N); });
  return y;
}

// q [B, Hq, N, D], k, v [B, Hkv, S, D] float32 (any strides; Hq a multiple of Hkv: query head h reads
// KV head h / (Hq / Hkv)) -> [B, Hq, N, D]: softmax(q k^T scale) v in bfloat16 products (above).
// causal_offset < 0: no mask; else query i sees keys j <= i + causal_offset.
at::Tensor attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          int64_t causal_offset) {
  TORCH_CHECK(has_avx512_bf16, "attention_bf16: needs a CPU with AVX-512 BF16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attention_bf16: q, k, v float32 [B, H, N, D]");
  const int64_t B = q.size(0), Hq = q.size(1), N = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D &&
              v.size(3) == D && Hq % Hkv == 0, "attention_bf16: shapes ", q.sizes(), k.sizes(), v.sizes());
  TORCH_CHECK(D % 64 == 0 && D <= 256, "attention_bf16: head size ", D, " (a multiple of 64, at most 256)");
  const int64_t blocks = (S + ATT_KEYS - 1) / ATT_KEYS, packed = blocks * ATT_KEYS * D;
  std::vector<uint16_t> kp(B * Hkv * packed), vp(B * Hkv * packed);
  const auto qa = q.accessor<float, 4>();
  const auto ka = k.accessor<float, 4>();
  const auto va = v.accessor<float, 4>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      pack_kv(ka[i / Hkv][i % Hkv], va[i / Hkv][i % Hkv], S, D, kp.data() + i * packed, vp.data() + i * packed);
  });
  at::Tensor out = at::empty({B, Hq, N, D}, q.options());
  auto oa = out.accessor<float, 4>();
  const int64_t tiles = (N + ATT_ROWS - 1) / ATT_ROWS, group = Hq / Hkv;
  at::parallel_for(0, B * Hq * tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (Hq * tiles), h = (t / tiles) % Hq, q0 = (t % tiles) * ATT_ROWS;
      const int64_t kv = b * Hkv + h / group;
      attention_tile(qa[b][h], q0, static_cast<int>(std::min<int64_t>(ATT_ROWS, N - q0)), S, D, kp.data() + kv * packed,
                     vp.data() + kv * packed, static_cast<float>(scale), causal_offset, oa[b][h]);
    }
  });
  return out;
}

// The activation quantization the kernels apply (block 64: int4's, 32: int8's), in natural k order
// (for the tests' error bounds): (codes int8 [M, K], block scales float32 [M, K/block]).
std::vector<at::Tensor> quantize_activations_op(const at::Tensor& x_, const c10::optional<at::Tensor>& pqs,
                                                int64_t block) {
  const at::Tensor x = x_.contiguous();
  TORCH_CHECK(block == QBLOCK4 || block == QBLOCK8 || block == QBLOCK_MAX, "block: ", QBLOCK4, " (int4), ", QBLOCK8,
              " (int8) or ", QBLOCK_MAX, " (the int8 prefill GEMM)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % block == 0, "x: float32 [M, block * n]");
  const QuantizedRows a = quantize_rows(x, pqs, static_cast<int>(block), false);
  at::Tensor xq = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({x.size(0), x.size(1) / block}, x.options());
  std::memcpy(xq.data_ptr<int8_t>(), a.xq.data(), a.xq.size());
  std::memcpy(dx.data_ptr<float>(), a.dx.data(), a.dx.size() * sizeof(float));
  return {xq, dx};
}

// Turn the int4 AVX-512 VNNI loop on or off; returns whether it is on after the call (never on a CPU without it).
bool use_avx512(bool enable) {
  avx512_int4 = enable && cpu_has_avx512_vnni();
  return avx512_int4;
}

TORCH_LIBRARY(litevlm_lowbit, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor zeros, Tensor? pre_quant_scale, int group_size, "
        "int gemv_max_rows, int tile_bytes, bool prefill_bf16=False, bool prefill_int8=False, bool tiles8=False) "
        "-> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int gemv_max_rows, int tile_bytes, "
        "bool prefill_bf16=False, bool prefill_int8=False) -> Tensor");
  m.def("fp16_linear(Tensor x, Tensor weight, int gemv_max_rows, int tile_bytes, bool prefill_bf16=False) -> Tensor");
  m.def("quantize_activations(Tensor x, Tensor? pre_quant_scale, int block) -> Tensor[]");
  m.def("use_avx512(bool enable) -> bool", &use_avx512);
  m.def("has_avx512_vnni() -> bool", [] { return has_avx512_vnni; });
  m.def("has_avx512_bf16() -> bool", [] { return has_avx512_bf16; });
  m.def("attention_bf16(Tensor q, Tensor k, Tensor v, float scale, int causal_offset) -> Tensor");
  m.def("attention_rows(Tensor q, Tensor k, Tensor v, Tensor allowed, float scale) -> Tensor");
  m.def("use_row_pool(bool enable) -> bool", [](bool enable) { return row_pool_on.exchange(enable); });
  m.def("set_helper_spin_us(int us) -> int", [](int64_t us) {
    TORCH_CHECK(us >= 0, "set_helper_spin_us: us >= 0 (0: helpers sleep at once)");
    return helper_spin_us.exchange(us);
  });
  m.def("helper_spin_now() -> int", [] { return spin_policy(); });
  // [calls shared with helpers, calls whose caller waited for a helper's chunk, ns waited], then zeroed
  m.def("row_pool_waits() -> int[]", [] {
    return std::vector<int64_t>{pool_calls.exchange(0), pool_waits.exchange(0), pool_wait_ns.exchange(0)};
  });
  m.def("set_cpus_available(int cpus) -> int", [](int64_t cpus) {
    TORCH_CHECK(cpus >= 1, "set_cpus_available: cpus >= 1");
    return cpus_available.exchange(cpus);
  });
  m.def("set_small_call_threads(int threads) -> int", [](int64_t threads) {
    TORCH_CHECK(threads >= 0, "set_small_call_threads: threads >= 0 (0: torch's own count)");
    return small_call_threads.exchange(threads);
  });
}

TORCH_LIBRARY_IMPL(litevlm_lowbit, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("fp16_linear", &fp16_linear);
  m.impl("quantize_activations", &quantize_activations_op);
  m.impl("attention_bf16", &attention_bf16);
  m.impl("attention_rows", &attention_rows);
}
