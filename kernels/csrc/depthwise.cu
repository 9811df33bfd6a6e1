// Depthwise 2-D convolution (groups == channels), forward and backward (CUDA), fp32 accumulation.
//  * forward, NCHW, square kernel 3/5/7, stride 1/2, dilation 1: each thread computes OPT consecutive outputs of
//    one row from a register row buffer (input reuse through registers and L1), weights in registers;
//  * forward, any other case (and channels_last): generic kernel, one output per thread, layout-aware order;
//  * input grad: for stride 1 / dilation 1 it is the forward with the flipped kernel and padding k-1-p (same
//    kernels); otherwise a generic gather kernel (no atomics);
//  * weight grad: per-block reduction of TAPS taps in registers over a chunk of positions, then one fp32
//    atomicAdd per block and tap into a (C, kh*kw) buffer.
#include "common.cuh"

namespace {

using ck::from_f;
using ck::to_f;

struct Geo {
  int N, C, H, W, Ho, Wo, KH, KW, sh, sw, ph, pw, dh, dw;
};

__device__ __forceinline__ int64_t addr(bool cl, int64_t n, int64_t c, int64_t h, int64_t w, int C, int H, int W) {
  return cl ? ((n * H + h) * W + w) * C + c : ((n * C + c) * H + h) * W + w;
}

// ------------------------------------------------------------------------------- fast NCHW forward
template <typename T, int K, int S, int OPT>
__global__ void dw_fwd_nchw_fast(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                                 T* __restrict__ y, Geo g, int wchunks, int64_t total) {
  constexpr int RW = (OPT - 1) * S + K;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int wc = idx % wchunks;
    int64_t t = idx / wchunks;
    const int ho = t % g.Ho;
    const int64_t nc = t / g.Ho;
    const int c = nc % g.C;
    const int wo0 = wc * OPT;
    float wr[K * K];
#pragma unroll
    for (int i = 0; i < K * K; ++i) wr[i] = to_f(w[c * K * K + i]);
    const float b0 = bias ? to_f(bias[c]) : 0.f;
    float acc[OPT];
#pragma unroll
    for (int o = 0; o < OPT; ++o) acc[o] = b0;
    const T* xp = x + nc * g.H * g.W;
    const int hi0 = ho * S - g.ph;
    const int wi0 = wo0 * S - g.pw;
    const bool interior = wi0 >= 0 && wi0 + RW <= g.W;
#pragma unroll
    for (int kh = 0; kh < K; ++kh) {
      const int hi = hi0 + kh;
      if (hi < 0 || hi >= g.H) continue;
      const T* row = xp + (int64_t)hi * g.W + wi0;
      float r[RW];
      if (interior) {
#pragma unroll
        for (int j = 0; j < RW; ++j) r[j] = to_f(row[j]);
      } else {
#pragma unroll
        for (int j = 0; j < RW; ++j) {
          const int wi = wi0 + j;
          r[j] = (wi >= 0 && wi < g.W) ? to_f(row[j]) : 0.f;
        }
      }
#pragma unroll
      for (int o = 0; o < OPT; ++o)
#pragma unroll
        for (int kw = 0; kw < K; ++kw) acc[o] = fmaf(wr[kh * K + kw], r[o * S + kw], acc[o]);
    }
    T* yp = y + (nc * g.Ho + ho) * g.Wo + wo0;
#pragma unroll
    for (int o = 0; o < OPT; ++o)
      if (wo0 + o < g.Wo) yp[o] = from_f<T>(acc[o]);
  }
}

// ------------------------------------------------------------------------------- generic forward
template <typename T>
__global__ void dw_fwd_generic(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                               T* __restrict__ y, Geo g, bool cl, int64_t total) {
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    int64_t t = idx;
    int c, ho, wo;
    int64_t n;
    if (cl) {
      c = t % g.C; t /= g.C; wo = t % g.Wo; t /= g.Wo; ho = t % g.Ho; n = t / g.Ho;
    } else {
      wo = t % g.Wo; t /= g.Wo; ho = t % g.Ho; t /= g.Ho; c = t % g.C; n = t / g.C;
    }
    float acc = bias ? to_f(bias[c]) : 0.f;
    const T* wp = w + (int64_t)c * g.KH * g.KW;
    for (int kh = 0; kh < g.KH; ++kh) {
      const int hi = ho * g.sh - g.ph + kh * g.dh;
      if (hi < 0 || hi >= g.H) continue;
      for (int kw = 0; kw < g.KW; ++kw) {
        const int wi = wo * g.sw - g.pw + kw * g.dw;
        if (wi < 0 || wi >= g.W) continue;
        acc = fmaf(to_f(wp[kh * g.KW + kw]), to_f(x[addr(cl, n, c, hi, wi, g.C, g.H, g.W)]), acc);
      }
    }
    y[addr(cl, n, c, ho, wo, g.C, g.Ho, g.Wo)] = from_f<T>(acc);
  }
}

// ------------------------------------------------------------------------------- generic input grad
template <typename T>
__global__ void dw_dgrad_generic(const T* __restrict__ dy, const T* __restrict__ w, T* __restrict__ dx, Geo g,
                                 bool cl, int64_t total) {
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    int64_t t = idx;
    int c, hi, wi;
    int64_t n;
    if (cl) {
      c = t % g.C; t /= g.C; wi = t % g.W; t /= g.W; hi = t % g.H; n = t / g.H;
    } else {
      wi = t % g.W; t /= g.W; hi = t % g.H; t /= g.H; c = t % g.C; n = t / g.C;
    }
    float acc = 0.f;
    const T* wp = w + (int64_t)c * g.KH * g.KW;
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
        acc = fmaf(to_f(wp[kh * g.KW + kw]), to_f(dy[addr(cl, n, c, ho, wo, g.C, g.Ho, g.Wo)]), acc);
      }
    }
    dx[addr(cl, n, c, hi, wi, g.C, g.H, g.W)] = from_f<T>(acc);
  }
}

// ------------------------------------------------------------------------------- weight grad
// block (TX channels) x (TY position rows); grid (position chunks, ceil(C/TX), ceil(KK/TAPS)).
template <typename T, int TX, int TAPS>
__global__ void dw_wgrad(const T* __restrict__ dy, const T* __restrict__ x, float* __restrict__ dw32, Geo g,
                         bool cl, int64_t P, int64_t chunk) {
  constexpr int TY = 256 / TX;
  __shared__ float red[TY][TX + 1];
  const int c = blockIdx.y * TX + threadIdx.x;
  const int tap0 = blockIdx.z * TAPS;
  const int KK = g.KH * g.KW;
  const int64_t p0 = (int64_t)blockIdx.x * chunk;
  const int64_t p1 = min(p0 + chunk, P);
  float acc[TAPS];
#pragma unroll
  for (int t = 0; t < TAPS; ++t) acc[t] = 0.f;
  if (c < g.C) {
    const int tid = TX == 1 ? threadIdx.x + threadIdx.y : threadIdx.y;
    for (int64_t pos = p0 + tid; pos < p1; pos += TY) {
      const int wo = pos % g.Wo;
      int64_t t = pos / g.Wo;
      const int ho = t % g.Ho;
      const int64_t n = t / g.Ho;
      const float gv = to_f(dy[addr(cl, n, c, ho, wo, g.C, g.Ho, g.Wo)]);
#pragma unroll
      for (int tt = 0; tt < TAPS; ++tt) {
        const int tap = tap0 + tt;
        if (tap >= KK) break;
        const int kh = tap / g.KW, kw = tap % g.KW;
        const int hi = ho * g.sh - g.ph + kh * g.dh;
        const int wi = wo * g.sw - g.pw + kw * g.dw;
        if (hi >= 0 && hi < g.H && wi >= 0 && wi < g.W)
          acc[tt] = fmaf(gv, to_f(x[addr(cl, n, c, hi, wi, g.C, g.H, g.W)]), acc[tt]);
      }
    }
  }
  if (TX == 1) {
    const int lane = threadIdx.y & 31, warp = threadIdx.y >> 5;
#pragma unroll
    for (int tt = 0; tt < TAPS; ++tt) {
      float v = acc[tt];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
      if (lane == 0) red[warp][tt % (TX + 1)] = v;  // TX + 1 == 2 slots: alternate to avoid a second barrier
      __syncthreads();
      if (threadIdx.y == 0 && c < g.C && tap0 + tt < KK) {
        float s = 0.f;
        for (int r = 0; r < TY / 32; ++r) s += red[r][tt % (TX + 1)];
        atomicAdd(dw32 + (int64_t)c * KK + tap0 + tt, s);
      }
    }
  } else {
#pragma unroll
    for (int tt = 0; tt < TAPS; ++tt) {
      red[threadIdx.y][threadIdx.x] = acc[tt];
      __syncthreads();
      if (threadIdx.y == 0 && c < g.C && tap0 + tt < KK) {
        float s = 0.f;
#pragma unroll
        for (int r = 0; r < TY; ++r) s += red[r][threadIdx.x];
        atomicAdd(dw32 + (int64_t)c * KK + tap0 + tt, s);
      }
      __syncthreads();
    }
  }
}

Geo make_geo(const at::Tensor& x, int KH, int KW, int Ho, int Wo, const std::vector<int64_t>& s,
             const std::vector<int64_t>& p, const std::vector<int64_t>& d) {
  return Geo{(int)x.size(0), (int)x.size(1), (int)x.size(2), (int)x.size(3), Ho, Wo, KH, KW,
             (int)s[0], (int)s[1], (int)p[0], (int)p[1], (int)d[0], (int)d[1]};
}

template <typename T, int K, int S>
void launch_fast(const T* x, const T* w, const T* b, T* y, const Geo& g, cudaStream_t stream) {
  constexpr int OPT = 4;
  const int wchunks = (int)ck::ceil_div(g.Wo, OPT);
  const int64_t total = (int64_t)g.N * g.C * g.Ho * wchunks;
  dw_fwd_nchw_fast<T, K, S, OPT><<<ck::grid_for(total, 256, 16), 256, 0, stream>>>(x, w, b, y, g, wchunks, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// y = depthwise(x, w) (+ bias); w contiguous (C, 1, KH, KW). Output preallocated in the layout of x.
template <typename T>
void forward_into(const T* x, const T* w, const T* b, T* y, const Geo& g, bool cl, cudaStream_t stream) {
  const bool fast = !cl && g.KH == g.KW && g.dh == 1 && g.dw == 1 && g.sh == g.sw && (g.sh == 1 || g.sh == 2) &&
                    (g.KH == 3 || g.KH == 5 || g.KH == 7);
  if (fast) {
    const int K = g.KH, S = g.sh;
    if (K == 3 && S == 1) return launch_fast<T, 3, 1>(x, w, b, y, g, stream);
    if (K == 3 && S == 2) return launch_fast<T, 3, 2>(x, w, b, y, g, stream);
    if (K == 5 && S == 1) return launch_fast<T, 5, 1>(x, w, b, y, g, stream);
    if (K == 5 && S == 2) return launch_fast<T, 5, 2>(x, w, b, y, g, stream);
    if (K == 7 && S == 1) return launch_fast<T, 7, 1>(x, w, b, y, g, stream);
    if (K == 7 && S == 2) return launch_fast<T, 7, 2>(x, w, b, y, g, stream);
  }
  const int64_t total = (int64_t)g.N * g.C * g.Ho * g.Wo;
  dw_fwd_generic<T><<<ck::grid_for(total, 256, 16), 256, 0, stream>>>(x, w, b, y, g, cl, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int TX, int TAPS>
void launch_wgrad(const T* dy, const T* x, float* dw32, const Geo& g, bool cl, cudaStream_t stream) {
  constexpr int TY = 256 / TX;
  const int64_t P = (int64_t)g.N * g.Ho * g.Wo;
  const int64_t gy = ck::ceil_div(g.C, TX), gz = ck::ceil_div(g.KH * g.KW, TAPS);
  const int64_t target = (int64_t)ck::num_sms() * 16;
  int64_t chunk = std::max<int64_t>(4 * TY, ck::ceil_div(P * gy * gz, target));
  chunk = ck::ceil_div(chunk, TY) * TY;
  dim3 grid((unsigned)ck::ceil_div(P, chunk), (unsigned)gy, (unsigned)gz), block(TX, TY);
  dw_wgrad<T, TX, TAPS><<<grid, block, 0, stream>>>(dy, x, dw32, g, cl, P, chunk);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int TX>
void wgrad(const T* dy, const T* x, float* dw32, const Geo& g, bool cl, cudaStream_t stream) {
  const int KK = g.KH * g.KW;
  if (KK == 9) return launch_wgrad<T, TX, 9>(dy, x, dw32, g, cl, stream);
  if (KK == 25) return launch_wgrad<T, TX, 25>(dy, x, dw32, g, cl, stream);
  if (KK % 7 == 0) return launch_wgrad<T, TX, 7>(dy, x, dw32, g, cl, stream);
  if (KK % 4 == 0) return launch_wgrad<T, TX, 4>(dy, x, dw32, g, cl, stream);
  return launch_wgrad<T, TX, 1>(dy, x, dw32, g, cl, stream);
}

void check(const at::Tensor& x, const at::Tensor& w, const char* op, bool cl) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda(), op, ": tensors 'x' and 'weight' must be CUDA tensors");
  TORCH_CHECK(x.dim() == 4 && w.dim() == 4 && w.size(0) == x.size(1) && w.size(1) == 1, op,
              ": expected x (N, C, H, W) and weight (C, 1, kh, kw)");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": 'weight' and 'x' must have the same dtype");
  TORCH_CHECK(x.is_contiguous(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous), op,
              ": tensor 'x' must be contiguous in the requested layout");
  TORCH_CHECK(x.numel() < (int64_t)1 << 62 && x.size(2) * x.size(3) < ((int64_t)1 << 31), op, ": tensor too large");
}

int out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) { return (int)((in + 2 * p - d * (k - 1) - 1) / s + 1); }

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
  if (y.numel() == 0) return y;
  at::Tensor wc = w.contiguous();
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
  at::Tensor wflip = unit ? w.flip({2, 3}).contiguous() : w.contiguous();
  CK_DISPATCH(x.scalar_type(), "dw_backward", [&] {
    const scalar_t* dyp = dy.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    if (unit) {
      // dx = correlation of dy with the flipped kernel, padding k-1-p: the forward kernels on dy.
      Geo gi{g.N, g.C, Ho, Wo, g.H, g.W, KH, KW, 1, 1, KH - 1 - g.ph, KW - 1 - g.pw, 1, 1};
      forward_into<scalar_t>(dyp, wflip.data_ptr<scalar_t>(), nullptr, dxp, gi, cl, stream);
    } else {
      const int64_t total = x.numel();
      dw_dgrad_generic<scalar_t><<<ck::grid_for(total, 256, 16), 256, 0, stream>>>(
          dyp, wflip.data_ptr<scalar_t>(), dxp, g, cl, total);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (cl)
      wgrad<scalar_t, 32>(dyp, xp, dw32.data_ptr<float>(), g, cl, stream);
    else
      wgrad<scalar_t, 1>(dyp, xp, dw32.data_ptr<float>(), g, cl, stream);
  });
  return {dx, dw32.to(w.scalar_type()).view(w.sizes())};
}
