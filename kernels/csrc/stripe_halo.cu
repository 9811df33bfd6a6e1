// Stripe conv forward, halo route (inference; float16 / bfloat16, channels_last, stride 1).
//
// A tile is TH output rows (all Wo columns) of one image; persistent blocks loop over tiles. A block stages every
// stripe's weight in shared memory once, and for each tile the input rows the tile reads, with the halo
// (QH = TH + (KH-1)*DH rows of QW = Wo + (KW-1)*DW positions, zeros outside the image; the next tile's rows are
// copied with cp.async into a second buffer while the block computes this one), then:
//   1. Z[q, s] = sum_c X[q, c] * w_s[c] for every staged position q and every stripe s: one small GEMM on tensor
//      cores (mma.m16n8k16, fp32 accumulate), stored to shared memory. Each stripe is multiplied once per input
//      position, whatever its output channel and offset.
//   2. y[p, o] = bias[o] + sum_{s of channel o} Z[p + dq_s, s], dq_s the stripe's shift in the staged tile; then
//      ReLU and optionally the 2x2 max-pool, written channels_last.
// Stripes come sorted by output channel (fstart[o] .. fstart[o+1]) with their weight rows zero-padded to
// (S_pad, C_pad), both multiples of 16 (kernels/stripe_halo.py prepares them once per layer).
// Why: on narrow, sparse layers the implicit-GEMM route multiplies whole dense tiles (every output channel of a
// tile at every offset any of them keeps); here the multiply-adds are the kept stripes' (times the halo's extra
// rows), and the per-stripe results never leave shared memory.
#include "common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

// The 16-bit element type of T and its tensor-core product: d (16x8 fp32) += a (16x16, row) * b (16x8, col).
template <typename T>
struct Mma;
template <>
struct Mma<at::Half> {
  using type = __half;
  static __device__ __forceinline__ void run(float* d, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
template <>
struct Mma<at::BFloat16> {
  using type = __nv_bfloat16;
  static __device__ __forceinline__ void run(float* d, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// Four 8x8 16-bit matrices from shared memory (lane l gives the row address of matrix l / 8).
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

constexpr int kThreads = 256;

struct HaloArgs {
  int B, C, H, W, N, S, Ho, Wo, KW, PH, PW, DH, DW;
  int TH, QH, QW, Q_pad, C_pad, C_ld, S_pad, S_ld, tiles;  // tiles: row tiles per image
  int Hp, Wp;                                               // pooled output size (pool only)
};

// Shared memory: Z (Q_pad x S_ld fp32) | 2 x X (Q_pad x C_ld) | W (S_pad x C_ld) | off (S int) | fstart (N+1 int)
inline size_t halo_smem_bytes(const HaloArgs& a, int elem) {
  return (size_t)a.Q_pad * a.S_ld * 4 + (size_t)(2 * a.Q_pad + a.S_pad) * a.C_ld * elem + (size_t)(a.S + a.N + 1) * 4;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }

// Start staging tile `tile`'s input rows into xs: in-image positions only (the halo columns, the channels from C
// to C_pad and the rows past QH*QW stay zero from the kernel's start); rows outside the image are zeroed. VEC
// (C % 8 == 0, x 16-byte aligned): 16-byte cp.async copies, complete after the caller's wait; else plain loads.
template <typename T, bool VEC>
__device__ __forceinline__ void stage_input(typename Mma<T>::type* xs, const T* __restrict__ x, const HaloArgs& a,
                                            int tile) {
  using E = typename Mma<T>::type;
  const int b = tile / a.tiles, h0 = (tile - b * a.tiles) * a.TH;
  if (VEC) {
    const int cw = a.C / 8, row = a.W * cw;
    for (int i = threadIdx.x; i < a.QH * row; i += kThreads) {
      const int r = i / row, rem = i - r * row, p = rem / cw, j = rem - p * cw;
      const int ih = h0 - a.PH + r;
      E* dst = xs + (r * a.QW + a.PW + p) * a.C_ld + j * 8;
      if (ih >= 0 && ih < a.H) cp_async16(dst, x + (((int64_t)b * a.H + ih) * a.W + p) * a.C + j * 8);
      else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  } else {
    const int row = a.W * a.C;
    for (int i = threadIdx.x; i < a.QH * row; i += kThreads) {
      const int r = i / row, rem = i - r * row, p = rem / a.C, c = rem - p * a.C;
      const int ih = h0 - a.PH + r;
      T v = T(0.f);
      if (ih >= 0 && ih < a.H) v = x[(((int64_t)b * a.H + ih) * a.W + p) * a.C + c];
      xs[(r * a.QW + a.PW + p) * a.C_ld + c] = *reinterpret_cast<const E*>(&v);
    }
  }
}

// One output value: init (the bias) + the stripes [s0, s1) of its channel, zq = Z's row of the pixel's unshifted
// staged position, off[s] = the stripe's element offset from there (its shift in rows of Z, plus s).
__device__ __forceinline__ float halo_sum(const float* zq, const int* off, int s0, int s1, float init) {
  float acc = init;
  for (int s = s0; s < s1; ++s) acc += zq[off[s]];
  return acc;
}

template <typename T, bool VEC, bool RELU, bool POOL>
__global__ void __launch_bounds__(kThreads) stripe_halo_fwd(const T* __restrict__ x, const T* __restrict__ w,
                                                            const int* __restrict__ sk,
                                                            const int* __restrict__ fstart,
                                                            const T* __restrict__ bias, T* __restrict__ y,
                                                            HaloArgs a) {
  using E = typename Mma<T>::type;
  extern __shared__ __align__(128) unsigned char smem[];
  float* z = reinterpret_cast<float*>(smem);
  E* xbuf = reinterpret_cast<E*>(z + (size_t)a.Q_pad * a.S_ld);  // two staged inputs, xstride apart
  const int xstride = a.Q_pad * a.C_ld;
  E* ws = xbuf + 2 * xstride;
  int* off = reinterpret_cast<int*>(ws + (size_t)a.S_pad * a.C_ld);
  int* fs = off + a.S;

  const int KW = a.KW;
  for (int s = threadIdx.x; s < a.S; s += kThreads) {
    const int k = sk[s];
    off[s] = ((k / KW) * a.DH * a.QW + (k % KW) * a.DW) * a.S_ld + s;
  }
  for (int o = threadIdx.x; o <= a.N; o += kThreads) fs[o] = fstart[o];
  const int wpr = a.C_pad / 8;
  for (int i = threadIdx.x; i < a.S_pad * wpr; i += kThreads) {
    const int r = i / wpr, j = i - r * wpr;
    *reinterpret_cast<uint4*>(ws + r * a.C_ld + j * 8) = reinterpret_cast<const uint4*>(w + (size_t)r * a.C_pad)[j];
  }
  for (int i = threadIdx.x; i < a.Q_pad * a.C_ld / 4; i += kThreads)  // both buffers: 2 * Q_pad * C_ld / 8 words
    reinterpret_cast<uint4*>(xbuf)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  const int total = a.B * a.tiles;
  if ((int)blockIdx.x < total) stage_input<T, VEC>(xbuf, x, a, blockIdx.x);
  cp_async_commit();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, MT = a.Q_pad / 16, NT = a.S_pad / 16, N = a.N;
  const unsigned ws_s = static_cast<unsigned>(__cvta_generic_to_shared(ws));
  const int ot = min(N, kThreads), lanes = kThreads / ot;  // epilogue: channels per pass, threads per channel
  int it = 0;
  for (int tile = blockIdx.x; tile < total; tile += gridDim.x, ++it) {
    const E* xs = xbuf + (it & 1) * xstride;
    if (tile + (int)gridDim.x < total) stage_input<T, VEC>(xbuf + ((it + 1) & 1) * xstride, x, a, tile + gridDim.x);
    cp_async_commit();
    cp_async_wait1();  // this tile's copies are done (the next tile's may still be in flight)
    __syncthreads();

    // 1. Z = X W^T on tensor cores (mma.m16n8k16, fp32): a warp takes 16 staged positions at a time and every
    // 16-stripe block for them; lane l addresses row l % 16 (x) or stripe l % 8 + 8 * (l / 16) (w) of the 8x8
    // matrices ldmatrix loads, so the registers come out in mma's fragment order.
    const unsigned xs_s = static_cast<unsigned>(__cvta_generic_to_shared(xs));
    for (int mt = warp; mt < MT; mt += kThreads / 32) {
      const unsigned a_row = xs_s + ((mt * 16 + lane % 16) * a.C_ld + (lane / 16) * 8) * 2;
      float* zrow = z + (mt * 16 + lane / 4) * a.S_ld + (lane % 4) * 2;
      for (int nt = 0; nt < NT; ++nt) {
        float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const unsigned b_row = ws_s + ((nt * 16 + lane % 8 + (lane / 16) * 8) * a.C_ld + ((lane / 8) % 2) * 8) * 2;
        for (int k0 = 0; k0 < a.C_pad; k0 += 16) {
          unsigned fa[4], fb[4];
          ldmatrix_x4(fa, a_row + k0 * 2);
          ldmatrix_x4(fb, b_row + k0 * 2);
          Mma<T>::run(d[0], fa, fb);
          Mma<T>::run(d[1], fa, fb + 2);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // stripes nt*16 + 8h + (lane % 4) * 2 (+1), positions lane / 4 (+8)
          *reinterpret_cast<float2*>(zrow + nt * 16 + 8 * h) = make_float2(d[h][0], d[h][1]);
          *reinterpret_cast<float2*>(zrow + 8 * a.S_ld + nt * 16 + 8 * h) = make_float2(d[h][2], d[h][3]);
        }
      }
    }
    __syncthreads();

    // 2. shifted sums, bias, ReLU, (pool), store. A thread keeps one output channel (consecutive threads:
    // consecutive channels, so stores coalesce) and walks the tile's pixels with the other `lanes` threads of it.
    const int b = tile / a.tiles, h0 = (tile - b * a.tiles) * a.TH;
    for (int o0 = 0; o0 < N; o0 += ot) {
      const int o = o0 + (int)threadIdx.x % ot, pl = (int)threadIdx.x / ot;  // pl: this thread's pixel lane
      if (pl >= lanes || o >= N) continue;
      const int s0 = fs[o], s1 = fs[o + 1];
      const float init = bias ? ck::to_f(bias[o]) : 0.f;
      if (!POOL) {
        const int rows = min(a.TH, a.Ho - h0);
        for (int r = 0; r < rows; ++r) {
          T* yr = y + ((int64_t)b * a.Ho + h0 + r) * a.Wo * N + o;
          for (int c = pl; c < a.Wo; c += lanes) {
            float v = halo_sum(z + (r * a.QW + c) * a.S_ld, off, s0, s1, init);
            if (RELU) v = fmaxf(v, 0.f);
            yr[(int64_t)c * N] = ck::from_f<T>(v);
          }
        }
      } else {  // TH is even: this tile's pooled rows are [h0/2, (h0+TH)/2) within Hp
        const int pr0 = h0 / 2, prows = min(a.TH / 2, a.Hp - pr0);
        for (int pr = 0; pr < prows; ++pr) {
          T* yr = y + ((int64_t)b * a.Hp + pr0 + pr) * a.Wp * N + o;
          const int rn = min(2, a.Ho - h0 - 2 * pr);  // rows of the window inside the output (ceil mode: 1 at the end)
          for (int pc = pl; pc < a.Wp; pc += lanes) {
            const int cn = min(2, a.Wo - 2 * pc);
            float v = -INFINITY;
            for (int dr = 0; dr < rn; ++dr)
              for (int dc = 0; dc < cn; ++dc)
                v = fmaxf(v, halo_sum(z + ((2 * pr + dr) * a.QW + 2 * pc + dc) * a.S_ld, off, s0, s1, init));
            if (RELU) v = fmaxf(v, 0.f);
            yr[(int64_t)pc * N] = ck::from_f<T>(v);
          }
        }
      }
    }
  }
}

template <typename T, bool VEC, bool RELU, bool POOL>
void launch(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sk, const at::Tensor& fstart,
            const c10::optional<at::Tensor>& bias, at::Tensor& y, const HaloArgs& a, size_t smem) {
  auto kern = stripe_halo_fwd<T, VEC, RELU, POOL>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kThreads, smem));
  const int64_t blocks = std::min<int64_t>((int64_t)a.B * a.tiles, (int64_t)std::max(per_sm, 1) * ck::num_sms());
  kern<<<(unsigned)blocks, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<T>(), w.data_ptr<T>(), sk.data_ptr<int>(), fstart.data_ptr<int>(),
      bias ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>(), a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The kernel instance for the run-time flags.
template <typename T, bool VEC>
void launch_flags(bool relu, bool pool, const at::Tensor& x, const at::Tensor& w, const at::Tensor& sk,
                  const at::Tensor& fstart, const c10::optional<at::Tensor>& bias, at::Tensor& y, const HaloArgs& a,
                  size_t smem) {
  if (relu) {
    if (pool) launch<T, VEC, true, true>(x, w, sk, fstart, bias, y, a, smem);
    else launch<T, VEC, true, false>(x, w, sk, fstart, bias, y, a, smem);
  } else {
    if (pool) launch<T, VEC, false, true>(x, w, sk, fstart, bias, y, a, smem);
    else launch<T, VEC, false, false>(x, w, sk, fstart, bias, y, a, smem);
  }
}

template <typename T>
void launch_any(bool vec, bool relu, bool pool, const at::Tensor& x, const at::Tensor& w, const at::Tensor& sk,
                const at::Tensor& fstart, const c10::optional<at::Tensor>& bias, at::Tensor& y, const HaloArgs& a,
                size_t smem) {
  if (vec) launch_flags<T, true>(relu, pool, x, w, sk, fstart, bias, y, a, smem);
  else launch_flags<T, false>(relu, pool, x, w, sk, fstart, bias, y, a, smem);
}

}  // namespace

// x (B, C, H, W) channels_last; w (S_pad, C_pad) stripe rows sorted by output channel; sk (S,) int32 flat
// offsets kh*KW + kw; fstart (N+1,) int32; returns y (B, N, Ho, Wo) (or pooled (B, N, Hp, Wp)) channels_last.
at::Tensor stripe_halo_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sk,
                               const at::Tensor& fstart, const c10::optional<at::Tensor>& bias, int64_t N,
                               std::vector<int64_t> kernel, std::vector<int64_t> padding,
                               std::vector<int64_t> dilation, int64_t tile_rows, bool relu, bool pool,
                               bool pool_ceil) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast),
              "stripe_halo_forward: x must be a channels_last 4-d CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "stripe_halo_forward: x must be float16 or bfloat16");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.dim() == 2 && w.size(0) % 16 == 0 &&
                  w.size(1) % 16 == 0 && w.size(1) >= x.size(1),
              "stripe_halo_forward: w must be contiguous (S_pad, C_pad), multiples of 16, x's dtype");
  TORCH_CHECK(sk.scalar_type() == at::kInt && fstart.scalar_type() == at::kInt && fstart.numel() == N + 1,
              "stripe_halo_forward: sk and fstart must be int32, fstart of N + 1 entries");
  if (bias) TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N, "stripe_halo_forward: bias");
  const c10::cuda::CUDAGuard guard(x.device());
  HaloArgs a;
  a.B = x.size(0), a.C = x.size(1), a.H = x.size(2), a.W = x.size(3), a.N = (int)N, a.S = (int)sk.numel();
  a.KW = (int)kernel[1], a.PH = (int)padding[0], a.PW = (int)padding[1], a.DH = (int)dilation[0],
  a.DW = (int)dilation[1];
  a.Ho = a.H + 2 * a.PH - (int)(kernel[0] - 1) * a.DH;
  a.Wo = a.W + 2 * a.PW - (int)(kernel[1] - 1) * a.DW;
  TORCH_CHECK(a.Ho >= 1 && a.Wo >= 1 && tile_rows >= 1, "stripe_halo_forward: empty output or tile");
  a.TH = (int)tile_rows;
  TORCH_CHECK(!pool || a.TH % 2 == 0, "stripe_halo_forward: pooling needs an even tile height");
  a.QH = a.TH + (int)(kernel[0] - 1) * a.DH;
  a.QW = a.Wo + (int)(kernel[1] - 1) * a.DW;
  a.Q_pad = (int)ck::ceil_div((int64_t)a.QH * a.QW, 16) * 16;
  a.C_pad = (int)w.size(1), a.C_ld = a.C_pad + 8, a.S_pad = (int)w.size(0), a.S_ld = a.S_pad + 8;
  a.tiles = (int)ck::ceil_div(a.Ho, a.TH);
  a.Hp = pool ? (pool_ceil ? (a.Ho + 1) / 2 : a.Ho / 2) : 0;
  a.Wp = pool ? (pool_ceil ? (a.Wo + 1) / 2 : a.Wo / 2) : 0;
  const size_t smem = halo_smem_bytes(a, (int)x.element_size());
  TORCH_CHECK(smem <= (size_t)at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin,
              "stripe_halo_forward: tile needs ", smem, " bytes of shared memory; use fewer tile rows");
  at::Tensor y = at::empty({a.B, a.N, pool ? a.Hp : a.Ho, pool ? a.Wp : a.Wo},
                           x.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (y.numel() == 0) return y;
  const bool vec = a.C % 8 == 0 && ck::aligned(x.data_ptr(), 16);
  AT_DISPATCH_SWITCH(x.scalar_type(), "stripe_halo_forward",
                     AT_DISPATCH_CASE(at::kHalf, [&] {
                       launch_any<scalar_t>(vec, relu, pool, x, w, sk, fstart, bias, y, a, smem);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       launch_any<scalar_t>(vec, relu, pool, x, w, sk, fstart, bias, y, a, smem);
                     }));
  return y;
}
