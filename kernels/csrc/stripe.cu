// Stripe convolution forward on tensor cores (CUDA; float16 / bfloat16, channels_last input, C % 8 == 0).
// Semantics: kernels/stripe.py. A block owns BM = 64 output pixels (flat over b, ho, wo) and BN = 128 output
// channels [n0, n0 + 128). For each kernel offset k whose stripes of the tile, [s_lo, s_lo + S_k) in the
// canonical order (plan), are not empty, and each 32-channel chunk of the input:
//   P[64, S_k] += A_k[64, 32] @ W[s_lo : s_lo + S_k, 32]^T       (mma.m16n8k16, fp32 accumulate)
// where A_k holds the input pixels under offset k (zero outside the image). After the last chunk, every warp
// adds its 16 rows of P into the fp32 tile Y[64, 128] in shared memory at the stripes' output channels (a
// warp owns its rows, and one offset has at most one stripe per channel: no two lanes add to one element).
// A and W chunks are double-buffered with cp.async, so the next step's loads overlap this step's math.
// Epilogue: bias, optional ReLU, stored in the output's strides.
#include "common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int BM = 64, BN = 128;  // pixels, output channels of a tile (input channels per step: CK)
constexpr int LDY = BN + 4;                // fp32 tile row stride
constexpr int kMaxTaps = 49;               // kernels up to 7x7
constexpr int kThreads = 128;              // 4 warps x 16 rows

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; zero-filled when !valid (the source address is then not read)
__device__ __forceinline__ void cp16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                        unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

struct Geo {
  int B, C, H, W, Ho, Wo, N, KH, KW, sh, sw, ph, pw, dh, dw;
  int64_t sy_b, sy_c, sy_h, sy_w;
};

template <typename T, int CK>
__global__ void __launch_bounds__(kThreads) stripe_fwd_mma(const T* __restrict__ x, const T* __restrict__ w,
                                                           const int* __restrict__ plan,
                                                           const int64_t* __restrict__ out_index,
                                                           const T* __restrict__ bias, T* __restrict__ y, Geo g,
                                                           bool relu) {
#if __CUDA_ARCH__ >= 800
  constexpr int LDS = CK + 8;  // shared row stride (elements): 16-byte rows at distinct bank groups for ldmatrix
  extern __shared__ __align__(16) unsigned char smem[];
  T* As = reinterpret_cast<T*>(smem);                      // [2][BM][LDS]
  T* Ws = As + 2 * BM * LDS;                                // [2][BN][LDS]
  float* Y = reinterpret_cast<float*>(Ws + 2 * BN * LDS);   // [BM][LDY]
  short* oc = reinterpret_cast<short*>(Y + BM * LDY);       // [taps][BN]: stripe j of tap t -> channel - n0
  __shared__ int tap_k[kMaxTaps], tap_lo[kMaxTaps], tap_n[kMaxTaps], lo_k[kMaxTaps], hi_k[kMaxTaps];
  __shared__ int n_taps;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int M = g.B * g.Ho * g.Wo;
  const int n0 = blockIdx.y * BN, n1 = min(n0 + BN, g.N), nv = n1 - n0;
  const int K = g.KH * g.KW;

  // once per block (persistent over pixel tiles): the offsets with stripes in this channel tile, their ranges
  for (int k = tid; k < K; k += kThreads) {
    lo_k[k] = plan[k * (g.N + 1) + n0];
    hi_k[k] = plan[k * (g.N + 1) + n1];
  }
  __syncthreads();
  if (tid == 0) {
    int t = 0;
    for (int k = 0; k < K; ++k)
      if (hi_k[k] > lo_k[k]) { tap_k[t] = k; tap_lo[t] = lo_k[k]; tap_n[t] = hi_k[k] - lo_k[k]; ++t; }
    n_taps = t;
  }
  __syncthreads();
  const int T_ = n_taps;
  for (int i = tid; i < T_ * BN; i += kThreads) {
    const int t = i / BN, j = i % BN;
    if (j < tap_n[t]) oc[i] = (short)(out_index[tap_lo[t] + j] - n0);
  }
  const int CC = (g.C + CK - 1) / CK;  // channel chunks per offset
  const int steps = T_ * CC;
  constexpr int VPR = CK / 8;  // 16-byte vectors per row

  for (int m0 = blockIdx.x * BM; m0 < M; m0 += gridDim.x * BM) {
    // this thread's A rows (pixels): (b, ih0, iw0) decoded once per tile
    constexpr int AR = BM * VPR / kThreads;
    int a_b[AR], a_ih[AR], a_iw[AR];
    bool a_ok[AR];
#pragma unroll
    for (int r = 0; r < AR; ++r) {
      const int row = (tid + r * kThreads) / VPR;
      const int m = m0 + row;
      a_ok[r] = m < M;
      const int mm = a_ok[r] ? m : 0;
      const int wo = mm % g.Wo, t2 = mm / g.Wo;
      a_b[r] = t2 / g.Ho;
      a_ih[r] = (t2 % g.Ho) * g.sh - g.ph;
      a_iw[r] = wo * g.sw - g.pw;
    }
    auto load_step = [&](int step, int buf) {
      const int t = step / CC, c0 = (step % CC) * CK;
      const int k = tap_k[t], lo = tap_lo[t], ns = tap_n[t];
      const int kh = k / g.KW, kw = k % g.KW;
      T* Ab = As + buf * BM * LDS;
      T* Wb = Ws + buf * BN * LDS;
#pragma unroll
      for (int r = 0; r < AR; ++r) {  // A: BM rows x VPR vectors of 8 channels
        const int idx = tid + r * kThreads, row = idx / VPR, part = idx % VPR;
        const int ih = a_ih[r] + kh * g.dh, iw = a_iw[r] + kw * g.dw, c = c0 + part * 8;
        const bool ok = a_ok[r] && ih >= 0 && ih < g.H && iw >= 0 && iw < g.W && c < g.C;
        const T* src = ok ? x + (((int64_t)a_b[r] * g.H + ih) * g.W + iw) * g.C + c : x;
        cp16(Ab + row * LDS + part * 8, src, ok);
      }
      const int nrows = (ns + 7) & ~7;  // rows the mma reads
      for (int idx = tid; idx < nrows * VPR; idx += kThreads) {  // W: the tap's stripes x VPR vectors
        const int row = idx / VPR, part = idx % VPR, c = c0 + part * 8;
        const bool ok = row < ns && c < g.C;
        const T* src = ok ? w + (int64_t)(lo + row) * g.C + c : w;
        cp16(Wb + row * LDS + part * 8, src, ok);
      }
    };

    for (int i = tid; i < BM * LDY; i += kThreads) Y[i] = 0.f;
    float P[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) P[j][0] = P[j][1] = P[j][2] = P[j][3] = 0.f;
    __syncthreads();  // Y zeroed, oc table visible, the previous tile's epilogue done
    if (steps > 0) load_step(0, 0);
    cp_commit();
    for (int step = 0; step < steps; ++step) {
      const int buf = step & 1;
      if (step + 1 < steps) load_step(step + 1, buf ^ 1);
      cp_commit();
      cp_wait<1>();
      __syncthreads();
      const int t = step / CC;
      const int ns = tap_n[t], nb = (ns + 7) >> 3;
      const T* Ab = As + buf * BM * LDS;
      const T* Wb = Ws + buf * BN * LDS;
#pragma unroll
      for (int ks = 0; ks < CK / 16; ++ks) {
        unsigned a[4];
        ldm_x4(a, Ab + (warp * 16 + (lane & 15)) * LDS + ks * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int j = 0; j < BN / 8; j += 2) {
          if (j < nb) {
            unsigned b[4];  // n8 blocks j and j + 1: lanes 0-15 rows of block j, 16-31 of block j + 1
            ldm_x4(b, Wb + (j * 8 + (lane & 7) + ((lane >> 4) << 3)) * LDS + ks * 16 + ((lane >> 3) & 1) * 8);
            mma16816<T>(P[j], a, b[0], b[1]);
            if (j + 1 < nb) mma16816<T>(P[j + 1], a, b[2], b[3]);
          }
        }
      }
      if (step % CC == CC - 1) {  // last chunk of this offset: P into Y at the stripes' channels, then P = 0
        const short* o = oc + t * BN;
        const int r0 = warp * 16 + (lane >> 2);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          if (j < nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int col = j * 8 + 2 * (lane & 3) + (e & 1);
              if (col < ns) Y[(r0 + (e >> 1) * 8) * LDY + o[col]] += P[j][e];
              P[j][e] = 0.f;
            }
          }
        }
      }
      __syncthreads();  // this buffer is refilled by the next iteration's prefetch
    }

    for (int i = tid; i < BM * nv; i += kThreads) {  // epilogue: channel fastest (coalesced channels_last stores)
      const int row = i / nv, c = i % nv;
      const int m = m0 + row, n = n0 + c;
      if (m >= M) continue;
      float v = Y[row * LDY + c];
      if (bias) v += to_float(bias[n]);
      if (relu) v = fmaxf(v, 0.f);
      const int wo = m % g.Wo, t2 = m / g.Wo;
      y[(t2 / g.Ho) * g.sy_b + n * g.sy_c + (t2 % g.Ho) * g.sy_h + wo * g.sy_w] = from_float<T>(v);
    }
    __syncthreads();  // Y is zeroed again for the next tile
  }
#endif
}

}  // namespace

// y = stripe_conv2d(x, ...) for float16 / bfloat16 x (channels_last, C % 8 == 0), into y (any strides).
at::Tensor stripe_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out_index, const at::Tensor& plan,
                          const c10::optional<at::Tensor>& bias, int64_t N, std::vector<int64_t> kernel,
                          std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
                          bool relu, bool cl_out) {
  const char* op = "compress::stripe_conv2d (CUDA tensor-core kernel)";
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast), op,
              ": x must be a 4-D channels_last CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op, ": x must be float16/bfloat16");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.dim() == 2 && w.size(1) == x.size(1), op,
              ": weight must be contiguous (S, C) in x's dtype");
  TORCH_CHECK(x.size(1) % 8 == 0, op, ": C must be a multiple of 8");
  TORCH_CHECK(plan.scalar_type() == at::kInt && plan.is_contiguous(), op, ": plan must be contiguous int32");
  TORCH_CHECK(out_index.scalar_type() == at::kLong && out_index.is_contiguous(), op, ": out_index must be int64");
  TORCH_CHECK(kernel[0] * kernel[1] <= kMaxTaps, op, ": kernels up to 7x7");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  Geo g;
  g.B = x.size(0); g.C = x.size(1); g.H = x.size(2); g.W = x.size(3); g.N = (int)N;
  g.KH = kernel[0]; g.KW = kernel[1]; g.sh = stride[0]; g.sw = stride[1]; g.ph = padding[0]; g.pw = padding[1];
  g.dh = dilation[0]; g.dw = dilation[1];
  g.Ho = (g.H + 2 * g.ph - g.dh * (g.KH - 1) - 1) / g.sh + 1;
  g.Wo = (g.W + 2 * g.pw - g.dw * (g.KW - 1) - 1) / g.sw + 1;
  auto y = at::empty({g.B, g.N, g.Ho, g.Wo}, x.options(),
                     cl_out ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  g.sy_b = y.stride(0); g.sy_c = y.stride(1); g.sy_h = y.stride(2); g.sy_w = y.stride(3);
  const int64_t M = (int64_t)g.B * g.Ho * g.Wo;
  TORCH_CHECK(x.numel() < ((int64_t)1 << 31) && M < ((int64_t)1 << 31), op, ": tensors up to 2^31 elements");
  if (M == 0 || g.N == 0) return y;
  const int taps = g.KH * g.KW;
  const int64_t mtiles = ck::ceil_div(M, BM), ntiles = ck::ceil_div(g.N, BN);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto tag, auto ckc) {
    using T = decltype(tag);
    constexpr int CKV = decltype(ckc)::value;
    const size_t smem = (size_t)2 * (BM + BN) * (CKV + 8) * sizeof(T) + (size_t)BM * LDY * 4 + (size_t)taps * BN * 2;
    auto kern = stripe_fwd_mma<T, CKV>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kThreads, smem));
    // persistent blocks: each channel tile's setup (offsets, stripe -> channel table) is done once per block
    const int64_t cap = std::max<int64_t>(1, (int64_t)ck::num_sms() * std::max(per_sm, 1) / ntiles);
    const dim3 grid((unsigned)std::min(mtiles, cap), (unsigned)ntiles);
    kern<<<grid, kThreads, smem, stream>>>(
        reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const T*>(w.data_ptr()), plan.data_ptr<int>(),
        out_index.data_ptr<int64_t>(), bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr,
        reinterpret_cast<T*>(y.data_ptr()), g, relu);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto with_ck = [&](auto tag) {
    if (g.C >= 64)
      launch(tag, std::integral_constant<int, 64>{});
    else
      launch(tag, std::integral_constant<int, 32>{});
  };
  if (x.scalar_type() == at::kHalf)
    with_ck(__half{});
  else
    with_ck(__nv_bfloat16{});
  return y;
}
