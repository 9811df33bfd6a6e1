// Depthwise 2-D convolution (groups == channels), forward and backward (CUDA), fp32 accumulation.
//  * forward, NCHW, square kernel 3/5/7, stride 1/2, dilation 1: each thread computes OPT consecutive outputs of
//    one row (of two rows for stride 2) from register row buffers (input reuse through registers and L1),
//    weights in registers; "same" padding on 7x7, 14x14 and 28x28 planes: whole planes staged in shared memory
//    by 16-byte copies, a lane per output row, outputs staged too (dw_fwd_nchw_staged);
//  * forward, channels_last, same geometries, C % 4 == 0: 4-channel vectors, OPT outputs of a row per thread;
//  * forward, any other case: generic kernel, one output per thread, layout-aware order;
//  * input grad: for stride 1 / dilation 1 it is the forward with the flipped kernel and padding k-1-p (same
//    kernels); NCHW stride 2 (square K 3/5/7, dilation 1): a phase-decomposed gather that visits only the taps
//    that hit (no modulo); otherwise a generic gather kernel (no atomics);
//  * weight grad, NCHW "same" padding on 7x7-28x28 planes: the staged forward's planes, tap sums per lane across
//    images (dw_wgrad_nchw_staged);
//  * weight grad, NCHW fast case: a block owns one channel and a chunk of its output row segments; each thread
//    keeps all K*K tap sums in registers (row buffers as in the forward), then a block reduction and one fp32
//    atomicAdd per tap and block. Other cases: the generic version of the same reduction.
// Index math is 32-bit (tensors up to 2^31 elements; checked).
#include "common.cuh"

#include <cstdlib>

namespace {

using ck::from_f;
using ck::to_f;

constexpr int kThreads = 256;
constexpr int kOPT = 4;

struct Geo {
  int N, C, H, W, Ho, Wo, KH, KW, sh, sw, ph, pw, dh, dw;
};

__device__ __forceinline__ int64_t addr(bool cl, int n, int c, int h, int w, int C, int H, int W) {
  return cl ? (((int64_t)n * H + h) * W + w) * C + c : (((int64_t)n * C + c) * H + h) * W + w;
}

// Row segment into registers (fast NCHW forward and weight grad): r[j] = row[j] as float for j < RW, where row
// points at column col0 of a row of ncols columns, 0 for the columns outside [0, ncols). A segment wholly inside
// the row is read without checks. V > 1: the NV aligned V-element vectors from OFF elements before row (see
// dw_fwd_nchw_fast); each lies wholly inside or wholly outside the row (ncols % V == 0, col0 - OFF a multiple
// of V), so with EDGE_VEC a segment at the row's ends is read as vectors too, checked per vector; without, it is
// read element by element (EDGE_VEC costs registers: see dw_fwd_nchw_fast).
template <typename T, int RW, int V = 1, int OFF = 0, bool EDGE_VEC = false>
__device__ __forceinline__ void load_row(float (&r)[RW], const T* row, int col0, int ncols) {
  constexpr int NV = (OFF + RW + V - 1) / V;
  if constexpr (V > 1) {
    const int vc0 = col0 - OFF;
    const bool interior = vc0 >= 0 && vc0 + NV * V <= ncols;
    if (EDGE_VEC || interior) {
      const ck::Vec<T, V>* rv = reinterpret_cast<const ck::Vec<T, V>*>(row - OFF);
      float buf[NV * V];
#pragma unroll
      for (int q = 0; q < NV; ++q) {
        if (!EDGE_VEC || interior || (vc0 + q * V >= 0 && vc0 + q * V < ncols)) {
          const ck::Vec<T, V> u = rv[q];
#pragma unroll
          for (int e = 0; e < V; ++e) buf[q * V + e] = to_f(u.v[e]);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) buf[q * V + e] = 0.f;
        }
      }
#pragma unroll
      for (int j = 0; j < RW; ++j) r[j] = buf[OFF + j];
      return;
    }
  }
  if (col0 >= 0 && col0 + RW <= ncols) {
#pragma unroll
    for (int j = 0; j < RW; ++j) r[j] = to_f(row[j]);
  } else {
#pragma unroll
    for (int j = 0; j < RW; ++j) {
      const int col = col0 + j;
      r[j] = (col >= 0 && col < ncols) ? to_f(row[j]) : 0.f;
    }
  }
}

// ------------------------------------------------------------------------------- fast NCHW forward
// A thread computes an R x OPT tile of outputs (R consecutive rows, OPT consecutive columns) of one channel: its
// K*K weights are loaded once per tile, and the (R-1)*S+K input rows the tile reads are each loaded once.
// V > 1 (stride 2): the row segment is read as aligned V-element vectors starting OFF elements before it
// (OFF = (-pw) mod V, so every thread's segment start wi0 - OFF is V-aligned when OPT*S % V == 0 and W % V == 0):
// 3-4 wide loads instead of RW scalar ones, whose 32-byte-strided lanes cost L1 wavefronts.
// Row ends read as vectors too (load_row's EDGE_VEC): with one output row per thread, and with two for 4-byte
// types and k5 (the measured case; k7 would spill), whose kernel is then held to 85 registers (3 blocks per SM,
// kBounded). H200 A/Bs on seed 004's stride-2 shapes
// (benchmarks/results/dw_s2_{head_a,vedge}_h200.json from one run, dw_s2_{head,r1,lb3}_h200.json from another:
// head = no EDGE_VEC; vedge = EDGE_VEC everywhere, no register bound; r1 = one row only; lb3 = everywhere,
// two-row kernels bounded; each against cuDNN and COMPRESS_DW_VEC=0 in the same process): one row 1.09-1.25x faster
// (k3, fp32 14x14-112x112 and bf16 56x56-112x112); two rows without the bound 0.66-1.17x (k5: up to 85 registers
// instead of 60-64: fewer resident blocks, a second wave on some grids); bounded, fp32 1.04-1.14x, bf16
// 0.67-0.99x. Register counts: benchmarks/results/ptxas_dw_fwd_registers_session13.txt.
template <typename T, int K, int R>
constexpr bool kBounded = R == 2 && K == 5 && sizeof(T) == 4;  // launched as dw_fwd_nchw_fast_bounded
template <typename T, int K, int R>
constexpr bool kEdgeVec = R == 1 || kBounded<T, K, R>;

template <typename T, int K, int S, int OPT, int R, int V, int OFF>
__device__ __forceinline__ void fwd_nchw_fast(const T* __restrict__ x, const T* __restrict__ w,
                                              const T* __restrict__ bias, T* __restrict__ y, const Geo& g,
                                              int wchunks, int hchunks, int total) {
  constexpr int RW = (OPT - 1) * S + K;
  constexpr int RH = (R - 1) * S + K;  // input rows of a tile
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    const int wc = idx % wchunks;
    const int t = idx / wchunks;
    const int ho0 = (t % hchunks) * R;
    const int nc = t / hchunks;
    const int c = nc % g.C;
    const int wo0 = wc * OPT;
    float wr[K * K];
#pragma unroll
    for (int i = 0; i < K * K; ++i) wr[i] = to_f(w[c * K * K + i]);
    const float b0 = bias ? to_f(bias[c]) : 0.f;
    float acc[R][OPT];
#pragma unroll
    for (int rr = 0; rr < R; ++rr)
#pragma unroll
      for (int o = 0; o < OPT; ++o) acc[rr][o] = b0;
    const T* xp = x + (int64_t)nc * g.H * g.W;
    const int hi0 = ho0 * S - g.ph;
    const int wi0 = wo0 * S - g.pw;
#pragma unroll
    for (int ir = 0; ir < RH; ++ir) {
      const int hi = hi0 + ir;
      if (hi < 0 || hi >= g.H) continue;
      float r[RW];
      load_row<T, RW, V, OFF, kEdgeVec<T, K, R>>(r, xp + hi * g.W + wi0, wi0, g.W);
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        const int kh = ir - rr * S;  // compile-time after unrolling
        if (kh < 0 || kh >= K) continue;
#pragma unroll
        for (int o = 0; o < OPT; ++o)
#pragma unroll
          for (int kw = 0; kw < K; ++kw) acc[rr][o] = fmaf(wr[kh * K + kw], r[o * S + kw], acc[rr][o]);
      }
    }
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      if (ho0 + rr >= g.Ho) break;
      T* yp = y + ((int64_t)nc * g.Ho + ho0 + rr) * g.Wo + wo0;
#pragma unroll
      for (int o = 0; o < OPT; ++o)
        if (wo0 + o < g.Wo) yp[o] = from_f<T>(acc[rr][o]);
    }
  }
}

// Two kernels around the same body: a __launch_bounds__ minimum of blocks per SM changes ptxas's register
// choice even where it is 1 (bf16 two-row kernels: 72 registers with (256, 1), 64 with (256)), so only the
// kBounded instantiations carry one (3 blocks: at most 85 registers).
template <typename T, int K, int S, int OPT, int R, int V = 1, int OFF = 0>
__global__ void __launch_bounds__(kThreads) dw_fwd_nchw_fast(const T* __restrict__ x, const T* __restrict__ w,
                                                             const T* __restrict__ bias, T* __restrict__ y, Geo g,
                                                             int wchunks, int hchunks, int total) {
  fwd_nchw_fast<T, K, S, OPT, R, V, OFF>(x, w, bias, y, g, wchunks, hchunks, total);
}

template <typename T, int K, int S, int OPT, int R, int V = 1, int OFF = 0>
__global__ void __launch_bounds__(kThreads, 3) dw_fwd_nchw_fast_bounded(const T* __restrict__ x,
                                                                        const T* __restrict__ w,
                                                                        const T* __restrict__ bias,
                                                                        T* __restrict__ y, Geo g, int wchunks,
                                                                        int hchunks, int total) {
  fwd_nchw_fast<T, K, S, OPT, R, V, OFF>(x, w, bias, y, g, wchunks, hchunks, total);
}

template <typename T, int K, int S, int OPT, int R, int V = 1, int OFF = 0>
void launch_fwd_nchw_fast(unsigned grid, cudaStream_t stream, const T* x, const T* w, const T* b, T* y, const Geo& g,
                          int wchunks, int hchunks, int total) {
  if constexpr (kBounded<T, K, R>)
    dw_fwd_nchw_fast_bounded<T, K, S, OPT, R, V, OFF><<<grid, kThreads, 0, stream>>>(x, w, b, y, g, wchunks, hchunks,
                                                                                     total);
  else
    dw_fwd_nchw_fast<T, K, S, OPT, R, V, OFF><<<grid, kThreads, 0, stream>>>(x, w, b, y, g, wchunks, hchunks, total);
}

// ------------------------------------------------------------------------------- staged NCHW forward, small planes
// "Same" padding (K / 2), stride S = 1 or 2, square planes of SIDE = 7, 14 or 28 (the later stages of
// MobileNet/EfficientNet): there most row segments of the register kernel touch a row's end, and 7-column rows
// allow no vectors. Here a warp owns P consecutive (n, c) planes, whose x span P*SIDE*SIDE elements is a whole
// number of 16-byte words: it copies them into its shared memory with 16-byte loads (no index math), then each
// lane computes whole output rows (HO outputs) of one plane from there into shared memory, and the warp writes
// the chunk's outputs with 8- or 16-byte stores. Needs N*C % P == 0 and 16-byte aligned x and y (staged_side).
// H200 (benchmarks/results/dw_s2_staged_warps_h200.json, each against cuDNN and the register kernel in one run):
// stride 2, fp32 1.69-2.32x cuDNN where the register kernel gave 1.34-1.66x, bf16 1.82-2.72x (1.39-1.74x); 2, 4
// or 8 warps per block within 0.0002 ms of each other except 8 on 7x7 planes (slower); 4 it is. Stride 1 and
// 28x28 planes (dw_staged_s1_{ystage,side28}_h200.json): stride 1 2.61-5.75x (register kernel 1.70-2.15x),
// stride 2 on 28x28 1.58-2.26x (1.23-1.59x). 56x56 planes would need more than 48 KiB of shared memory per block
// and 56 accumulators per lane; not tried.
constexpr int kStagedWarps = 4;
template <int S, int SIDE>
constexpr int kStagedHo = S == 2 ? (SIDE + 1) / 2 : SIDE;  // output side with padding K / 2, K odd

// Planes per warp: the fewest that give about a warp of output rows (>= 28) and whose x span is whole 16-byte
// words (bf16 7x7 at stride 1: 8 planes, 56 rows, two per lane for most lanes).
template <typename T, int S, int SIDE>
constexpr int staged_planes() {
  int p = 1;
  while (p * kStagedHo<S, SIDE> < 28 || (p * SIDE * SIDE * (int)sizeof(T)) % 16 != 0) ++p;
  return p;
}

// Per warp, in 16-byte words: the chunk's x, then its y (the forward's output, the weight grad's dy: P*HO*HO
// elements, a multiple of 8 bytes for every instantiation, moved with 16-byte words when a multiple of 16, else
// 8-byte ones).
template <typename T, int S, int SIDE>
constexpr int kStagedXWords = staged_planes<T, S, SIDE>() * SIDE * SIDE * (int)sizeof(T) / 16;
template <typename T, int S, int SIDE>
constexpr int kStagedYBytes = staged_planes<T, S, SIDE>() * kStagedHo<S, SIDE> * kStagedHo<S, SIDE> * (int)sizeof(T);
template <typename T, int S, int SIDE>
constexpr int kStagedWords = kStagedXWords<T, S, SIDE> + (kStagedYBytes<T, S, SIDE> + 15) / 16;

// The input rows that output row oh reads in a staged SIDE x SIDE plane (padding K / 2): for each tap row kh whose
// input row lies inside the plane, f(kh, r) with r[j] = column j - K / 2 of that row (0 outside the plane).
template <typename T, int K, int S, int SIDE, int RW, typename F>
__device__ __forceinline__ void for_staged_rows(const T* plane, int oh, F&& f) {
  constexpr int PAD = K / 2;
#pragma unroll
  for (int kh = 0; kh < K; ++kh) {
    const int hi = S * oh - PAD + kh;
    if (hi < 0 || hi >= SIDE) continue;
    float r[RW];
#pragma unroll
    for (int j = 0; j < RW; ++j) {
      const int col = j - PAD;  // compile-time after unrolling
      r[j] = col >= 0 && col < SIDE ? to_f(plane[hi * SIDE + col]) : 0.f;
    }
    f(kh, r);
  }
}

template <typename T, int K, int S, int SIDE>
__global__ void __launch_bounds__(kThreads) dw_fwd_nchw_staged(const T* __restrict__ x, const T* __restrict__ w,
                                                               const T* __restrict__ bias, T* __restrict__ y, int C,
                                                               int chunks) {
  constexpr int P = staged_planes<T, S, SIDE>(), HO = kStagedHo<S, SIDE>, XWORDS = kStagedXWords<T, S, SIDE>;
  constexpr int YBYTES = kStagedYBytes<T, S, SIDE>;
  constexpr int RW = S * (HO - 1) + K;  // input columns -K/2 .. RW - 1 - K/2 of a row
  static_assert(YBYTES % 8 == 0, "outputs of a chunk must be whole 8-byte words");
  static_assert(kStagedWarps * kStagedWords<T, S, SIDE> * 16 <= 48 * 1024, "a block's stage must fit in 48 KiB");
  extern __shared__ uint4 smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunk = blockIdx.x * (blockDim.x >> 5) + warp;
  if (chunk >= chunks) return;  // whole warps
  uint4* xs4 = smem + warp * kStagedWords<T, S, SIDE>;
  T* ys = reinterpret_cast<T*>(xs4 + XWORDS);
  ck::warp_copy<8>(xs4, reinterpret_cast<const uint4*>(x) + (int64_t)chunk * XWORDS, XWORDS, lane);
  __syncwarp();
  for (int row = lane; row < P * HO; row += 32) {
    const int p = row / HO, oh = row - p * HO;
    const int plane = chunk * P + p;
    const int c = plane % C;
    float wr[K * K];
#pragma unroll
    for (int i = 0; i < K * K; ++i) wr[i] = to_f(w[c * K * K + i]);
    const float b0 = bias ? to_f(bias[c]) : 0.f;
    const T* xp = reinterpret_cast<const T*>(xs4) + p * SIDE * SIDE;
    float acc[HO];
#pragma unroll
    for (int o = 0; o < HO; ++o) acc[o] = b0;
    for_staged_rows<T, K, S, SIDE, RW>(xp, oh, [&](int kh, const float(&r)[RW]) {
#pragma unroll
      for (int o = 0; o < HO; ++o)
#pragma unroll
        for (int kw = 0; kw < K; ++kw) acc[o] = fmaf(wr[kh * K + kw], r[S * o + kw], acc[o]);
    });
#pragma unroll
    for (int o = 0; o < HO; ++o) ys[row * HO + o] = from_f<T>(acc[o]);
  }
  __syncwarp();
  // each lane writing its own row element by element (rows HO elements apart across the warp) took 2.4x as long
  // at stride 1 on fp32 480x14x14 k3 (0.0120 against 0.0050 ms: dw_staged_s1_h200.json, _ystage_h200.json)
  if constexpr (YBYTES % 16 == 0)
    ck::warp_store(reinterpret_cast<uint4*>(y) + (int64_t)chunk * (YBYTES / 16), reinterpret_cast<const uint4*>(ys),
               YBYTES / 16, lane);
  else
    ck::warp_store(reinterpret_cast<uint2*>(y) + (int64_t)chunk * (YBYTES / 8), reinterpret_cast<const uint2*>(ys),
               YBYTES / 8, lane);
}

// ------------------------------------------------------------------------------- channels_last forward
// NHWC, square K 3/5/7, stride 1/2, dilation 1, C % V == 0: each thread computes OPT consecutive output pixels
// of one row for V consecutive channels; every load is a V-channel vector (coalesced along C across the warp),
// the input row segment sits in registers (reused by the OPT outputs), weights are (KK, C) (transposed), read
// as V-channel vectors per tap.
template <typename T, int K, int S, int OPT, int V>
__global__ void __launch_bounds__(kThreads) dw_fwd_nhwc(const T* __restrict__ x, const T* __restrict__ w,
                                                        const T* __restrict__ bias, T* __restrict__ y, Geo g,
                                                        int CV, int wchunks, int total) {
  constexpr int RW = (OPT - 1) * S + K;
  using VT = ck::Vec<T, V>;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    const int cv = idx % CV;
    int t = idx / CV;
    const int wc = t % wchunks;
    t /= wchunks;
    const int ho = t % g.Ho;
    const int n = t / g.Ho;
    const int c0 = cv * V;
    const int wo0 = wc * OPT;
    float acc[OPT][V];
    {
      float b0[V];
      if (bias) {
        const VT bv = *reinterpret_cast<const VT*>(bias + c0);
#pragma unroll
        for (int e = 0; e < V; ++e) b0[e] = to_f(bv.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) b0[e] = 0.f;
      }
#pragma unroll
      for (int o = 0; o < OPT; ++o)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[o][e] = b0[e];
    }
    const int hi0 = ho * S - g.ph;
    const int wi0 = wo0 * S - g.pw;
#pragma unroll
    for (int kh = 0; kh < K; ++kh) {
      const int hi = hi0 + kh;
      if (hi < 0 || hi >= g.H) continue;
      const T* rowp = x + ((int64_t)n * g.H + hi) * g.W * g.C + c0;
      float r[RW][V];
#pragma unroll
      for (int j = 0; j < RW; ++j) {
        const int wi = wi0 + j;
        if (wi >= 0 && wi < g.W) {
          const VT u = *reinterpret_cast<const VT*>(rowp + wi * g.C);
#pragma unroll
          for (int e = 0; e < V; ++e) r[j][e] = to_f(u.v[e]);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) r[j][e] = 0.f;
        }
      }
#pragma unroll
      for (int kw = 0; kw < K; ++kw) {
        const VT wv = *reinterpret_cast<const VT*>(w + (kh * K + kw) * g.C + c0);
        float wf[V];
#pragma unroll
        for (int e = 0; e < V; ++e) wf[e] = to_f(wv.v[e]);
#pragma unroll
        for (int o = 0; o < OPT; ++o)
#pragma unroll
          for (int e = 0; e < V; ++e) acc[o][e] = fmaf(wf[e], r[o * S + kw][e], acc[o][e]);
      }
    }
    T* yp = y + (((int64_t)n * g.Ho + ho) * g.Wo + wo0) * g.C + c0;
#pragma unroll
    for (int o = 0; o < OPT; ++o) {
      if (wo0 + o < g.Wo) {
        VT out;
#pragma unroll
        for (int e = 0; e < V; ++e) out.v[e] = from_f<T>(acc[o][e]);
        *reinterpret_cast<VT*>(yp + (int64_t)o * g.C) = out;
      }
    }
  }
}

// ------------------------------------------------------------------------------- generic forward
// weight element (c, tap) at w[c * wsC + tap * wsK] (NCHW: (C, KK); channels_last: transposed (KK, C)).
template <typename T>
__global__ void dw_fwd_generic(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                               T* __restrict__ y, Geo g, bool cl, int total, int wsC, int wsK) {
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    int t = idx, c, ho, wo, n;
    if (cl) {
      c = t % g.C; t /= g.C; wo = t % g.Wo; t /= g.Wo; ho = t % g.Ho; n = t / g.Ho;
    } else {
      wo = t % g.Wo; t /= g.Wo; ho = t % g.Ho; t /= g.Ho; c = t % g.C; n = t / g.C;
    }
    float acc = bias ? to_f(bias[c]) : 0.f;
    for (int kh = 0; kh < g.KH; ++kh) {
      const int hi = ho * g.sh - g.ph + kh * g.dh;
      if (hi < 0 || hi >= g.H) continue;
      for (int kw = 0; kw < g.KW; ++kw) {
        const int wi = wo * g.sw - g.pw + kw * g.dw;
        if (wi < 0 || wi >= g.W) continue;
        acc = fmaf(to_f(w[c * wsC + (kh * g.KW + kw) * wsK]), to_f(x[addr(cl, n, c, hi, wi, g.C, g.H, g.W)]), acc);
      }
    }
    y[addr(cl, n, c, ho, wo, g.C, g.Ho, g.Wo)] = from_f<T>(acc);
  }
}

// ------------------------------------------------------------------------------- fast NCHW input grad, stride 2
// dx[hi, wi] = sum of w[kh, kw] * dy[(hi + ph - kh) / 2, (wi + pw - kw) / 2] over the taps where both numerators
// are even and in range. Phase decomposition, no division or modulo: each thread computes OPT (even) consecutive
// dx of one row starting at an even column wi0, so the parity of wi0 + o + pw - kw is the compile-time parity of
// P + o - kw (P = pw & 1, a template argument) and only the taps that hit are visited; the rows' parity test is
// one bit. The dy row segment the thread needs (columns Q + DMIN .. Q + DMAX, Q = (wi0 + pw - P) / 2) sits in
// registers.
template <typename T, int K, int OPT, int P>
__global__ void __launch_bounds__(kThreads) dw_dgrad_s2_nchw(const T* __restrict__ dy, const T* __restrict__ w,
                                                             T* __restrict__ dx, Geo g, int wchunks, int total) {
  static_assert(OPT % 2 == 0, "OPT must be even");
  constexpr int M0 = P - (K - 1);
  constexpr int DMIN = (M0 % 2 == 0) ? M0 / 2 : (M0 + 1) / 2;
  constexpr int M1 = P + OPT - 1;
  constexpr int DMAX = (M1 % 2 == 0) ? M1 / 2 : (M1 - 1) / 2;
  constexpr int NB = DMAX - DMIN + 1;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    const int wc = idx % wchunks;
    const int t = idx / wchunks;
    const int hi = t % g.H;
    const int nc = t / g.H;
    const int c = nc % g.C;
    const int wi0 = wc * OPT;
    float wr[K * K];
#pragma unroll
    for (int i = 0; i < K * K; ++i) wr[i] = to_f(w[c * K * K + i]);
    float acc[OPT];
#pragma unroll
    for (int o = 0; o < OPT; ++o) acc[o] = 0.f;
    const int Q = (wi0 + g.pw - P) >> 1;
    const bool interior = Q + DMIN >= 0 && Q + DMAX < g.Wo;
    const T* dyp = dy + (int64_t)nc * g.Ho * g.Wo;
#pragma unroll
    for (int kh = 0; kh < K; ++kh) {
      const int th = hi + g.ph - kh;
      if (th < 0 || (th & 1)) continue;
      const int ho = th >> 1;
      if (ho >= g.Ho) continue;
      const T* row = dyp + ho * g.Wo + Q;
      float r[NB];
      if (interior) {
#pragma unroll
        for (int j = 0; j < NB; ++j) r[j] = to_f(row[DMIN + j]);
      } else {
#pragma unroll
        for (int j = 0; j < NB; ++j) {
          const int wo = Q + DMIN + j;
          r[j] = (wo >= 0 && wo < g.Wo) ? to_f(row[DMIN + j]) : 0.f;
        }
      }
#pragma unroll
      for (int o = 0; o < OPT; ++o)
#pragma unroll
        for (int kw = 0; kw < K; ++kw)
          if (((P + o - kw) & 1) == 0) acc[o] = fmaf(wr[kh * K + kw], r[(P + o - kw) / 2 - DMIN], acc[o]);
    }
    T* dxp = dx + ((int64_t)nc * g.H + hi) * g.W + wi0;
#pragma unroll
    for (int o = 0; o < OPT; ++o)
      if (wi0 + o < g.W) dxp[o] = from_f<T>(acc[o]);
  }
}

// ------------------------------------------------------------------------------- generic input grad
template <typename T>
__global__ void dw_dgrad_generic(const T* __restrict__ dy, const T* __restrict__ w, T* __restrict__ dx, Geo g,
                                 bool cl, int total, int wsC, int wsK) {
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    int t = idx, c, hi, wi, n;
    if (cl) {
      c = t % g.C; t /= g.C; wi = t % g.W; t /= g.W; hi = t % g.H; n = t / g.H;
    } else {
      wi = t % g.W; t /= g.W; hi = t % g.H; t /= g.H; c = t % g.C; n = t / g.C;
    }
    float acc = 0.f;
    for (int kh = 0; kh < g.KH; ++kh) {
      const int th = hi + g.ph - kh * g.dh;
      if (th < 0 || th % g.sh) continue;
      const int ho = th / g.sh;
      if (ho >= g.Ho) continue;
      for (int kw = 0; kw < g.KW; ++kw) {
        const int tw = wi + g.pw - kw * g.dw;
        if (tw < 0 || tw % g.sw) continue;
        const int wo = tw / g.sw;
        if (wo >= g.Wo) continue;
        acc = fmaf(to_f(w[c * wsC + (kh * g.KW + kw) * wsK]), to_f(dy[addr(cl, n, c, ho, wo, g.C, g.Ho, g.Wo)]), acc);
      }
    }
    dx[addr(cl, n, c, hi, wi, g.C, g.H, g.W)] = from_f<T>(acc);
  }
}

// Sum v over the block's warps into red[warp][slot]; caller syncs.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

// ------------------------------------------------------------------------------- fast NCHW weight grad
// grid (chunks, C); items of channel c: (n, ho, wchunk), N*Ho*wchunks of them; block = kThreads threads.
template <typename T, int K, int S, int OPT>
__global__ void __launch_bounds__(kThreads) dw_wgrad_nchw_fast(const T* __restrict__ dy, const T* __restrict__ x,
                                                               float* __restrict__ dw32, Geo g, int wchunks,
                                                               int items, int chunk) {
  constexpr int RW = (OPT - 1) * S + K;
  constexpr int KK = K * K;
  __shared__ float red[kThreads / 32][KK];
  const int c = blockIdx.y;
  const int i0 = blockIdx.x * chunk;
  const int i1 = min(i0 + chunk, items);
  float acc[KK];
#pragma unroll
  for (int t = 0; t < KK; ++t) acc[t] = 0.f;
  for (int it = i0 + threadIdx.x; it < i1; it += blockDim.x) {
    const int wc = it % wchunks;
    const int t = it / wchunks;
    const int ho = t % g.Ho;
    const int n = t / g.Ho;
    const int wo0 = wc * OPT;
    const int64_t plane = (int64_t)n * g.C + c;
    const T* dyp = dy + (plane * g.Ho + ho) * g.Wo + wo0;
    float gv[OPT];
#pragma unroll
    for (int o = 0; o < OPT; ++o) gv[o] = (wo0 + o < g.Wo) ? to_f(dyp[o]) : 0.f;
    const T* xp = x + plane * g.H * g.W;
    const int hi0 = ho * S - g.ph;
    const int wi0 = wo0 * S - g.pw;
#pragma unroll
    for (int kh = 0; kh < K; ++kh) {
      const int hi = hi0 + kh;
      if (hi < 0 || hi >= g.H) continue;
      float r[RW];
      load_row<T, RW>(r, xp + hi * g.W + wi0, wi0, g.W);
#pragma unroll
      for (int kw = 0; kw < K; ++kw)
#pragma unroll
        for (int o = 0; o < OPT; ++o) acc[kh * K + kw] = fmaf(gv[o], r[o * S + kw], acc[kh * K + kw]);
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int t = 0; t < KK; ++t) {
    const float v = warp_sum(acc[t]);
    if (lane == 0) red[warp][t] = v;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < KK; t += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < kThreads / 32; ++r) s += red[r][t];
    atomicAdd(dw32 + (int64_t)c * KK + t, s);
  }
}

// ------------------------------------------------------------------------------- staged NCHW weight grad
// The staged forward's planes (staged_side, and C % P == 0): a block owns one group of P consecutive channels and
// a slice of the batch; each of its warps stages the x and dy of one image's P planes at a time (16- or 8-byte
// copies), and each lane keeps the K*K tap sums of its output row(s) of one plane in registers across the images
// it visits (the lane -> (plane, row) map is the same for every image). At the end shuffles sum the lanes of each
// plane, shared-memory atomics the warps, and one global atomicAdd per channel, tap and block adds the block's share.
template <typename T, int K, int S, int SIDE>
__global__ void __launch_bounds__(kThreads) dw_wgrad_nchw_staged(const T* __restrict__ dy, const T* __restrict__ x,
                                                                 float* __restrict__ dw32, int N, int C,
                                                                 int nsplit) {
  constexpr int P = staged_planes<T, S, SIDE>(), HO = kStagedHo<S, SIDE>, XWORDS = kStagedXWords<T, S, SIDE>;
  constexpr int YBYTES = kStagedYBytes<T, S, SIDE>, WORDS = kStagedWords<T, S, SIDE>;
  constexpr int RW = S * (HO - 1) + K, KK = K * K, R = (P * HO + 31) / 32;
  static_assert(kStagedWarps * WORDS * 16 + P * KK * 4 <= 48 * 1024, "a block's stage must fit in 48 KiB");
  extern __shared__ uint4 smem[];  // per warp: x then dy words; then red[P][KK] floats
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int groups = C / P;
  const int cg = blockIdx.x / nsplit, ns = blockIdx.x - cg * nsplit;
  uint4* xs4 = smem + warp * WORDS;
  uint4* gs4 = xs4 + XWORDS;
  float* red = reinterpret_cast<float*>(smem + warps * WORDS);
  for (int i = threadIdx.x; i < P * KK; i += blockDim.x) red[i] = 0.f;
  float acc[R][KK];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < KK; ++t) acc[r][t] = 0.f;
  for (int n = ns * warps + warp; n < N; n += nsplit * warps) {
    const int64_t chunk = (int64_t)n * groups + cg;  // its planes: n*C + cg*P ...
    ck::warp_copy<8>(xs4, reinterpret_cast<const uint4*>(x) + chunk * XWORDS, XWORDS, lane);
    if constexpr (YBYTES % 16 == 0)
      ck::warp_copy<8>(gs4, reinterpret_cast<const uint4*>(dy) + chunk * (YBYTES / 16), YBYTES / 16, lane);
    else
      ck::warp_copy<8>(reinterpret_cast<uint2*>(gs4), reinterpret_cast<const uint2*>(dy) + chunk * (YBYTES / 8),
                       YBYTES / 8, lane);
    __syncwarp();
    const T* xs = reinterpret_cast<const T*>(xs4);
    const T* gs = reinterpret_cast<const T*>(gs4);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = lane + 32 * r;
      if (row >= P * HO) break;
      const int p = row / HO, oh = row - p * HO;
      float gv[HO];
#pragma unroll
      for (int o = 0; o < HO; ++o) gv[o] = to_f(gs[row * HO + o]);
      const T* xp = xs + p * SIDE * SIDE;
      for_staged_rows<T, K, S, SIDE, RW>(xp, oh, [&](int kh, const float(&rr)[RW]) {
#pragma unroll
        for (int kw = 0; kw < K; ++kw)
#pragma unroll
          for (int o = 0; o < HO; ++o) acc[r][kh * K + kw] = fmaf(gv[o], rr[S * o + kw], acc[r][kh * K + kw]);
      });
    }
    __syncwarp();  // before the next image's copy overwrites the stage
  }
  __syncthreads();  // red zeroed
  // Sum the lanes of each plane (consecutive lanes) with shuffles first: every lane adding its sums to shared
  // memory made up to 28 lanes hit one address, 2-4x slower than the register kernel
  // (dw_staged_wgrad_smem_atomics_h200.json).
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = lane + 32 * r;
    const bool valid = row < P * HO;
    const int p = valid ? row / HO : 0;
    const int first = max(0, p * HO - 32 * r), last = valid ? min(31, (p + 1) * HO - 1 - 32 * r) : lane;
#pragma unroll
    for (int t = 0; t < KK; ++t) {
      float v = valid ? acc[r][t] : 0.f;
#pragma unroll
      for (int off = 1; off < 32; off *= 2) {  // v = sum of lanes lane .. last of the plane
        const float o = __shfl_down_sync(0xffffffffu, v, off);
        if (lane + off <= last) v += o;
      }
      if (valid && lane == first) atomicAdd(red + p * KK + t, v);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < P * KK; i += blockDim.x) atomicAdd(dw32 + (int64_t)cg * P * KK + i, red[i]);
}

// ------------------------------------------------------------------------------- generic weight grad
// block (TX channels) x (TY position rows); grid (position chunks, ceil(C/TX), K > 0 ? 1 : KH*KW).
// K > 0: square K x K kernel, all taps in registers; K == 0: one tap per blockIdx.z.
template <typename T, int TX, int K>
__global__ void dw_wgrad_generic(const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ dw32, Geo g,
                                 bool cl, int P, int chunk) {
  constexpr int TY = kThreads / TX;
  constexpr int NT = K > 0 ? K * K : 1;
  __shared__ float red[TY][TX + 1];
  const int c = blockIdx.y * TX + threadIdx.x;
  const int KK = g.KH * g.KW;
  const int ztap = blockIdx.z;
  const int zkh = ztap / g.KW, zkw = ztap % g.KW;
  const int p0 = blockIdx.x * chunk;
  const int p1 = min(p0 + chunk, P);
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  if (c < g.C) {
    for (int pos = p0 + threadIdx.y; pos < p1; pos += TY) {
      const int wo = pos % g.Wo;
      const int t = pos / g.Wo;
      const int ho = t % g.Ho;
      const int n = t / g.Ho;
      const float gv = to_f(dy[addr(cl, n, c, ho, wo, g.C, g.Ho, g.Wo)]);
#pragma unroll
      for (int tt = 0; tt < NT; ++tt) {
        const int kh = K > 0 ? tt / (K > 0 ? K : 1) : zkh;
        const int kw = K > 0 ? tt % (K > 0 ? K : 1) : zkw;
        const int hi = ho * g.sh - g.ph + kh * g.dh;
        const int wi = wo * g.sw - g.pw + kw * g.dw;
        if (hi >= 0 && hi < g.H && wi >= 0 && wi < g.W)
          acc[tt] = fmaf(gv, to_f(x[addr(cl, n, c, hi, wi, g.C, g.H, g.W)]), acc[tt]);
      }
    }
  }
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) {
    float v = acc[tt];
    if (TX == 1) {  // a warp spans 32 position rows of one channel
      v = warp_sum(v);
      if ((threadIdx.y & 31) == 0) red[threadIdx.y >> 5][0] = v;
      __syncthreads();
      if (threadIdx.y == 0) {
        float s = 0.f;
        for (int r = 0; r < TY / 32; ++r) s += red[r][0];
        atomicAdd(dw32 + (int64_t)c * KK + (K > 0 ? tt : ztap), s);
      }
    } else {
      red[threadIdx.y][threadIdx.x] = v;
      __syncthreads();
      if (threadIdx.y == 0 && c < g.C) {
        float s = 0.f;
#pragma unroll
        for (int r = 0; r < TY; ++r) s += red[r][threadIdx.x];
        atomicAdd(dw32 + (int64_t)c * KK + (K > 0 ? tt : ztap), s);
      }
    }
    __syncthreads();
  }
}

Geo make_geo(const at::Tensor& x, int KH, int KW, int Ho, int Wo, const std::vector<int64_t>& s,
             const std::vector<int64_t>& p, const std::vector<int64_t>& d) {
  return Geo{(int)x.size(0), (int)x.size(1), (int)x.size(2), (int)x.size(3), Ho, Wo, KH, KW,
             (int)s[0], (int)s[1], (int)p[0], (int)p[1], (int)d[0], (int)d[1]};
}

bool fast_case(const Geo& g, bool cl) {
  return !cl && g.KH == g.KW && g.dh == 1 && g.dw == 1 && g.sh == g.sw && (g.sh == 1 || g.sh == 2) &&
         (g.KH == 3 || g.KH == 5 || g.KH == 7);
}

// The staged kernels' calls: padding K / 2 (stride 1 or 2, fast_case), square 7x7, 14x14 or 28x28 planes, whole
// chunks of planes, 16-byte aligned x and y (x and dy for the weight grad); COMPRESS_DW_STAGED=0 turns both off
// (A/B runs).
template <typename T, int S, int SIDE>
bool staged_side(const Geo& g, const void* x, const void* y) {
  const char* env = std::getenv("COMPRESS_DW_STAGED");
  return g.H == SIDE && g.W == SIDE && (int64_t)g.N * g.C % staged_planes<T, S, SIDE>() == 0 && ck::aligned(x, 16) &&
         ck::aligned(y, 16) && !(env && env[0] == '0');
}

// channels_last fast forward: same geometries as fast_case, channels a multiple of the 4-channel vector.
bool nhwc_case(const Geo& g, bool cl) {
  return cl && g.C % 4 == 0 && g.KH == g.KW && g.dh == 1 && g.dw == 1 && g.sh == g.sw && (g.sh == 1 || g.sh == 2) &&
         (g.KH == 3 || g.KH == 5 || g.KH == 7);
}

template <typename F>
void with_ks(const Geo& g, F&& f) {  // f(K, S) as integral constants, for fast_case geometries
  const int K = g.KH, S = g.sh;
  if (K == 3 && S == 1) return f(std::integral_constant<int, 3>{}, std::integral_constant<int, 1>{});
  if (K == 3 && S == 2) return f(std::integral_constant<int, 3>{}, std::integral_constant<int, 2>{});
  if (K == 5 && S == 1) return f(std::integral_constant<int, 5>{}, std::integral_constant<int, 1>{});
  if (K == 5 && S == 2) return f(std::integral_constant<int, 5>{}, std::integral_constant<int, 2>{});
  if (K == 7 && S == 1) return f(std::integral_constant<int, 7>{}, std::integral_constant<int, 1>{});
  return f(std::integral_constant<int, 7>{}, std::integral_constant<int, 2>{});
}

// f(K, S, SIDE) (integral constants) where the staged kernels take the call: fast_case with padding K / 2 and
// a plane staged_side accepts for `in` and `out`. Returns f's result (whether it launched), else false.
template <typename T, typename F>
bool with_staged(const Geo& g, bool cl, const void* in, const void* out, F&& f) {
  if (!fast_case(g, cl) || g.ph != g.KH / 2 || g.pw != g.KW / 2) return false;
  bool launched = false;
  with_ks(g, [&](auto Kc, auto Sc) {
    constexpr int S = decltype(Sc)::value;
    auto side = [&](auto Sidec) {
      if (!launched && staged_side<T, S, decltype(Sidec)::value>(g, in, out)) launched = f(Kc, Sc, Sidec);
    };
    side(std::integral_constant<int, 7>{});
    side(std::integral_constant<int, 14>{});
    side(std::integral_constant<int, 28>{});
  });
  return launched;
}

// The staged kernel, where it takes the call; returns whether it launched.
template <typename T>
bool forward_staged(const T* x, const T* w, const T* b, T* y, const Geo& g, bool cl, cudaStream_t stream) {
  return with_staged<T>(g, cl, x, y, [&](auto Kc, auto Sc, auto Sidec) {
    constexpr int K = decltype(Kc)::value, S = decltype(Sc)::value, SIDE = decltype(Sidec)::value;
    const int chunks = (int)((int64_t)g.N * g.C / staged_planes<T, S, SIDE>());
    dw_fwd_nchw_staged<T, K, S, SIDE><<<(unsigned)ck::ceil_div(chunks, kStagedWarps), kStagedWarps * 32,
                                        kStagedWarps * kStagedWords<T, S, SIDE> * 16, stream>>>(x, w, b, y, g.C,
                                                                                               chunks);
    return true;
  });
}

// y = depthwise(x, w) (+ bias). w: contiguous (C, KK) for NCHW, transposed (KK, C) for channels_last.
template <typename T>
void forward_into(const T* x, const T* w, const T* b, T* y, const Geo& g, bool cl, cudaStream_t stream) {
  if (forward_staged(x, w, b, y, g, cl, stream)) {
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (fast_case(g, cl)) {
    with_ks(g, [&](auto Kc, auto Sc) {
      constexpr int K = decltype(Kc)::value, S = decltype(Sc)::value;
      // Stride 2, K >= 5: two output rows per thread (the K*K weights and the shared input rows loaded once for
      // both) while that grid still has >= 384 threads per SM. H200 A/B (benchmarks/results/kernels_dw_rows_h200.json,
      // fwd_ms = two rows everywhere, fwd_ms_rows1 = one): k5 on 14x14 and 28x28 planes 1.02-1.22x faster; k3
      // 0.77-1.06x, k5 on 7x7 planes (36k threads) 0.77-0.87x. Since row ends are read as vectors (kEdgeVec),
      // 4-byte rows of 28+ columns take one row: fp32 240x28x28 k5 0.0104 ms against 0.0122 for two rows
      // (kernels_dw_session13_twopass_h200.json, fwd_ms_rows1 vs fwd_ms; fp32 14x14 planes still 1.14-1.25x faster
      // with two). COMPRESS_DW_ROWS=1|2 forces one or two (A/B runs).
      const int wchunks = (int)ck::ceil_div(g.Wo, kOPT);
      const char* rows_env = std::getenv("COMPRESS_DW_ROWS");
      const bool wide_fp32 = sizeof(T) == 4 && g.W >= 28;
      const bool two_rows =
          S == 2 && (rows_env && (rows_env[0] == '1' || rows_env[0] == '2')
                         ? rows_env[0] == '2'
                         : K >= 5 && !wide_fp32 &&
                               (int64_t)g.N * g.C * ck::ceil_div(g.Ho, 2) * wchunks >= 384LL * ck::num_sms());
      const int hchunks = (int)ck::ceil_div(g.Ho, two_rows ? 2 : 1);
      const int total = g.N * g.C * hchunks * wchunks;
      const unsigned grid = ck::grid_for(total, kThreads, 16);
      // stride 2 with "same" padding (pw = K/2): vector loads (V = 16 bytes, or 8 when W is not a multiple of 16
      // bytes; also at a row's ends, see kEdgeVec); COMPRESS_DW_VEC=0 turns them off (A/B
      // measurements). Tried: 4-byte vectors for 16-bit rows that 8 bytes do not divide (14x14 bf16): 0.85x.
      constexpr int VF = 16 / (int)sizeof(T) > kOPT * S ? kOPT * S : 16 / (int)sizeof(T);  // full vector
      constexpr int VH = VF / 2 > 1 ? VF / 2 : 2;                                           // half vector
      const char* env = std::getenv("COMPRESS_DW_VEC");
      const bool vec_ok = S == 2 && g.pw == K / 2 && ck::aligned(x, 16) && !(env && env[0] == '0');
      auto launch = [&](auto Rc) {
        constexpr int R = decltype(Rc)::value;
        if (vec_ok && g.W % VF == 0) {
          launch_fwd_nchw_fast<T, K, S, kOPT, R, VF, (VF - (K / 2) % VF) % VF>(grid, stream, x, w, b, y, g, wchunks,
                                                                               hchunks, total);
        } else if (vec_ok && VH < VF && g.W % VH == 0) {
          launch_fwd_nchw_fast<T, K, S, kOPT, R, VH, (VH - (K / 2) % VH) % VH>(grid, stream, x, w, b, y, g, wchunks,
                                                                               hchunks, total);
        } else {
          launch_fwd_nchw_fast<T, K, S, kOPT, R>(grid, stream, x, w, b, y, g, wchunks, hchunks, total);
        }
      };
      if (two_rows)
        launch(std::integral_constant<int, 2>{});
      else
        launch(std::integral_constant<int, 1>{});
    });
  } else if (nhwc_case(g, cl) && ck::aligned(x, 4 * sizeof(T)) && ck::aligned(w, 4 * sizeof(T)) &&
             ck::aligned(y, 4 * sizeof(T)) && (b == nullptr || ck::aligned(b, 4 * sizeof(T)))) {
    constexpr int V = 4;
    with_ks(g, [&](auto Kc, auto Sc) {
      constexpr int K = decltype(Kc)::value, S = decltype(Sc)::value;
      constexpr int OPT = S == 1 ? 4 : 2;
      const int wchunks = (int)ck::ceil_div(g.Wo, OPT);
      const int CV = g.C / V;
      const int total = g.N * g.Ho * wchunks * CV;
      dw_fwd_nhwc<T, K, S, OPT, V><<<ck::grid_for(total, kThreads, 16), kThreads, 0, stream>>>(x, w, b, y, g, CV,
                                                                                              wchunks, total);
    });
  } else {
    const int total = g.N * g.C * g.Ho * g.Wo;
    const int KK = g.KH * g.KW;
    dw_fwd_generic<T><<<ck::grid_for(total, kThreads, 16), kThreads, 0, stream>>>(x, w, b, y, g, cl, total,
                                                                                  cl ? 1 : KK, cl ? g.C : 1);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// dx for the stride-2 fast case (NCHW, square K in {3, 5, 7}, dilation 1): phase-decomposed kernel.
template <typename T>
void dgrad_s2(const T* dy, const T* w, T* dx, const Geo& g, cudaStream_t stream) {
  const int wchunks = (int)ck::ceil_div(g.W, kOPT);
  const int total = g.N * g.C * g.H * wchunks;
  const unsigned grid = ck::grid_for(total, kThreads, 16);
  auto go = [&](auto Kc, auto Pc) {
    constexpr int K = decltype(Kc)::value, P = decltype(Pc)::value;
    dw_dgrad_s2_nchw<T, K, kOPT, P><<<grid, kThreads, 0, stream>>>(dy, w, dx, g, wchunks, total);
  };
  const bool odd = g.pw & 1;
  using I0 = std::integral_constant<int, 0>;
  using I1 = std::integral_constant<int, 1>;
  if (g.KH == 3) odd ? go(std::integral_constant<int, 3>{}, I1{}) : go(std::integral_constant<int, 3>{}, I0{});
  else if (g.KH == 5) odd ? go(std::integral_constant<int, 5>{}, I1{}) : go(std::integral_constant<int, 5>{}, I0{});
  else odd ? go(std::integral_constant<int, 7>{}, I1{}) : go(std::integral_constant<int, 7>{}, I0{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int TX, int K>
void launch_wgrad_generic(const T* dy, const T* x, float* dw32, const Geo& g, bool cl, cudaStream_t stream) {
  constexpr int TY = kThreads / TX;
  const int P = g.N * g.Ho * g.Wo;
  const int64_t gy = ck::ceil_div(g.C, TX), gz = K > 0 ? 1 : g.KH * g.KW;
  const int64_t target = (int64_t)ck::num_sms() * 16;
  int64_t chunk = std::max<int64_t>(4 * TY, ck::ceil_div((int64_t)P * gy * gz, target));
  chunk = ck::ceil_div(chunk, TY) * TY;
  dim3 grid((unsigned)ck::ceil_div(P, chunk), (unsigned)gy, (unsigned)gz), block(TX, TY);
  dw_wgrad_generic<T, TX, K><<<grid, block, 0, stream>>>(dy, x, dw32, g, cl, P, (int)chunk);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The staged weight-grad kernel where it takes the call (the staged forward's planes and C % P == 0); returns
// whether it launched. Blocks: C / P channel groups x nsplit batch slices.
template <typename T>
bool wgrad_staged(const T* dy, const T* x, float* dw32, const Geo& g, bool cl, cudaStream_t stream) {
  return with_staged<T>(g, cl, x, dy, [&](auto Kc, auto Sc, auto Sidec) {
    constexpr int K = decltype(Kc)::value, S = decltype(Sc)::value, SIDE = decltype(Sidec)::value;
    constexpr int P = staged_planes<T, S, SIDE>();
    if (g.C % P != 0) return false;
    // One image per warp (nsplit = ceil(N / warps)): the configuration measured and GPU-tested. With fewer
    // slices each warp's loop visits several images (fewer global atomics), which no GPU run has checked yet.
    const int groups = g.C / P, warps = kStagedWarps;
    const int nsplit = (int)ck::ceil_div(g.N, warps);
    const size_t bytes = (size_t)warps * kStagedWords<T, S, SIDE> * 16 + (size_t)P * K * K * sizeof(float);
    dw_wgrad_nchw_staged<T, K, S, SIDE><<<(unsigned)(groups * nsplit), warps * 32, bytes, stream>>>(dy, x, dw32, g.N,
                                                                                                   g.C, nsplit);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  });
}

template <typename T>
void wgrad(const T* dy, const T* x, float* dw32, const Geo& g, bool cl, cudaStream_t stream) {
  if (wgrad_staged(dy, x, dw32, g, cl, stream)) return;
  if (fast_case(g, cl)) {
    with_ks(g, [&](auto Kc, auto Sc) {
      constexpr int K = decltype(Kc)::value, S = decltype(Sc)::value;
      const int wchunks = (int)ck::ceil_div(g.Wo, kOPT);
      const int items = g.N * g.Ho * wchunks;
      int64_t chunks = ck::ceil_div((int64_t)ck::num_sms() * 8, g.C);
      chunks = std::max<int64_t>(1, std::min<int64_t>(chunks, items / (2 * kThreads)));
      const int chunk = (int)ck::ceil_div(items, chunks);
      dim3 grid((unsigned)ck::ceil_div(items, chunk), (unsigned)g.C);
      dw_wgrad_nchw_fast<T, K, S, kOPT><<<grid, kThreads, 0, stream>>>(dy, x, dw32, g, wchunks, items, chunk);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return;
  }
  const bool sq = g.KH == g.KW;
  if (cl) {
    if (sq && g.KH == 3) return launch_wgrad_generic<T, 32, 3>(dy, x, dw32, g, cl, stream);
    if (sq && g.KH == 5) return launch_wgrad_generic<T, 32, 5>(dy, x, dw32, g, cl, stream);
    return launch_wgrad_generic<T, 32, 0>(dy, x, dw32, g, cl, stream);
  }
  if (sq && g.KH == 3) return launch_wgrad_generic<T, 1, 3>(dy, x, dw32, g, cl, stream);
  if (sq && g.KH == 5) return launch_wgrad_generic<T, 1, 5>(dy, x, dw32, g, cl, stream);
  return launch_wgrad_generic<T, 1, 0>(dy, x, dw32, g, cl, stream);
}

void check(const at::Tensor& x, const at::Tensor& w, const char* op, bool cl) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda(), op, ": tensors 'x' and 'weight' must be CUDA tensors");
  TORCH_CHECK(x.dim() == 4 && w.dim() == 4 && w.size(0) == x.size(1) && w.size(1) == 1, op,
              ": expected x (N, C, H, W) and weight (C, 1, kh, kw)");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": 'weight' and 'x' must have the same dtype");
  TORCH_CHECK(x.is_contiguous(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous), op,
              ": tensor 'x' must be contiguous in the requested layout");
  TORCH_CHECK(x.numel() < ((int64_t)1 << 31) - 1, op, ": tensor 'x' has too many elements for the kernel (2^31)");
}

int out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) { return (int)((in + 2 * p - d * (k - 1) - 1) / s + 1); }

// weight as the kernels want it: (C, KK) contiguous for NCHW, (KK, C) for channels_last
at::Tensor weight_for(const at::Tensor& w, bool cl) {
  return cl ? w.reshape({w.size(0), -1}).t().contiguous() : w.contiguous();
}

}  // namespace

at::Tensor dw_forward(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                      std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
                      bool cl) {
  check(x, w, "compress::depthwise_conv2d", cl);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const int KH = (int)w.size(2), KW = (int)w.size(3);
  const int Ho = out_size(x.size(2), KH, stride[0], padding[0], dilation[0]);
  const int Wo = out_size(x.size(3), KW, stride[1], padding[1], dilation[1]);
  auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  auto y = at::empty({x.size(0), x.size(1), Ho, Wo}, x.options().memory_format(fmt));
  TORCH_CHECK(y.numel() < ((int64_t)1 << 31) - 1, "compress::depthwise_conv2d: output too large for the kernel");
  if (y.numel() == 0) return y;
  at::Tensor wc = weight_for(w, cl);
  at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  Geo g = make_geo(x, KH, KW, Ho, Wo, stride, padding, dilation);
  auto stream = at::cuda::getCurrentCUDAStream();
  CK_DISPATCH(x.scalar_type(), "dw_forward", [&] {
    forward_into<scalar_t>(x.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                           bc.defined() ? bc.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), g, cl, stream);
  });
  return y;
}

std::vector<at::Tensor> dw_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                    std::vector<int64_t> stride, std::vector<int64_t> padding,
                                    std::vector<int64_t> dilation, bool cl) {
  check(x, w, "compress::depthwise_conv2d_backward", cl);
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  TORCH_CHECK(dy.is_contiguous(fmt) && dy.scalar_type() == x.scalar_type(),
              "compress::depthwise_conv2d_backward: tensor 'grad' must match x's dtype and layout");
  TORCH_CHECK(dy.numel() < ((int64_t)1 << 31) - 1, "compress::depthwise_conv2d_backward: 'grad' too large");
  const int KH = (int)w.size(2), KW = (int)w.size(3);
  const int Ho = (int)dy.size(2), Wo = (int)dy.size(3);
  auto dx = at::empty_like(x, x.options().memory_format(fmt));
  auto dw32 = at::zeros({w.size(0), KH * KW}, x.options().dtype(at::kFloat));
  if (x.numel() == 0 || dy.numel() == 0) {
    dx.zero_();
    return {dx, dw32.to(w.scalar_type()).view(w.sizes())};
  }
  Geo g = make_geo(x, KH, KW, Ho, Wo, stride, padding, dilation);
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool unit = g.sh == 1 && g.sw == 1 && g.dh == 1 && g.dw == 1;
  at::Tensor wk = weight_for(unit ? w.flip({2, 3}) : w, cl);
  CK_DISPATCH(x.scalar_type(), "dw_backward", [&] {
    const scalar_t* dyp = dy.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    if (unit) {
      // dx = correlation of dy with the flipped kernel, padding k-1-p: the forward kernels on dy.
      Geo gi{g.N, g.C, Ho, Wo, g.H, g.W, KH, KW, 1, 1, KH - 1 - g.ph, KW - 1 - g.pw, 1, 1};
      forward_into<scalar_t>(dyp, wk.data_ptr<scalar_t>(), nullptr, dxp, gi, cl, stream);
    } else if (fast_case(g, cl) && g.sh == 2) {
      dgrad_s2<scalar_t>(dyp, wk.data_ptr<scalar_t>(), dxp, g, stream);
    } else {
      const int total = (int)x.numel();
      const int KK = KH * KW;
      dw_dgrad_generic<scalar_t><<<ck::grid_for(total, kThreads, 16), kThreads, 0, stream>>>(
          dyp, wk.data_ptr<scalar_t>(), dxp, g, cl, total, cl ? 1 : KK, cl ? g.C : 1);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    wgrad<scalar_t>(dyp, xp, dw32.data_ptr<float>(), g, cl, stream);
  });
  return {dx, dw32.to(w.scalar_type()).view(w.sizes())};
}
