"""Small C++ CPU kernels, compiled on first use with the system C++ compiler and called through ctypes.

No PyTorch headers: one source (``SOURCE``), one ``c++ -O3 -fopenmp -shared`` call (15-50 s on 2 cores, once;
the compiler is ``$CXX`` if set, split as a shell would (``CXX="ccache g++"``), else the first of c++, g++, clang++), cached as a shared library in
``$COMPRESS_KERNELS_CACHE/cpu`` (default ``~/.cache/compress_kernels/cpu``), named by a hash of the source, the
flags and the machine, not the compiler: a library prebuilt by ``python -m kernels build`` loads where no compiler
is found at run time (the compiler is looked for only to build one). A cached file that is not a whole library (truncated on disk: dlopen would
crash the process) is rebuilt. With GCC on x86-64 the float32 workers are ``target_clones``
(AVX-512, AVX2, baseline x86-64), so one library runs on any x86-64 CPU. Where this cannot work (no compiler, a
compile or load error, or ``COMPRESS_KERNELS_NO_CPU=1``) ``lib()`` returns ``None``, after ONE warning unless the
variable asked for it, and the ops keep their PyTorch CPU path.

Threads: the passes run on torch's intra-op threads. The library is linked with ``-fopenmp`` against
``libgomp.so.1``; torch's CPU build loads its own ``libgomp.so.1`` first (torch/lib), so the dynamic loader binds
ours to it: one OpenMP runtime and thread pool, and ``torch.set_num_threads`` (``omp_set_num_threads``) sets our
team size too (``compress_omp_max_threads()`` reports it). A pass forks only for x of at least 32768 elements
(``PAR_MIN``; the predictor: G * C * B); each thread takes one contiguous share of rows (NCHW: B*G) or positions
(channels_last: B*H*W), so a result depends on the thread count only in the channels_last pool (per-thread sums
in double, added in thread order). Where ``-fopenmp`` does not build or load, the library is built without it
(``SERIAL_FLAGS``) and the kernels run single-threaded. A compile error is remembered in a ``.failed`` file beside
the library, with the compiler's command: later processes with that command do not compile again (named in the
warning: delete it to try again, e.g. after installing OpenMP); a compiler killed by a signal (the OOM killer) is
not remembered. The outcome, and its one warning, are kept per process, the outcome first (under ``-W error`` the
warning raises once).
A torch that uses another OpenMP runtime (e.g. Intel's libiomp5) would leave ours with a pool of its own.
The kernels are memory-bound passes (in a 1-thread PiX ResNet-50 forward they run at about the speed of a copy
of their input).

PiX, semantics as ``compress::pix`` / ``compress::pix_squeeze`` and the CUDA kernels:
``y[b,g] = p[b,g] * max_k x[b,g*Z+k]`` if ``p[b,g] < tau`` (tau cast to x's dtype) else
``p[b,g] * (sum_k x[b,g*Z+k] / Z)``; the max keeps the first value on ties and lets a NaN win, as PyTorch's (``nan_max``), the sum
runs over k in order. x and y are contiguous in the same layout (NCHW or channels_last).

- ``pix_{nchw,cl}_{f32,f64}(x, p, y, B, G, Z, HW, tau)``: the fusion for a given p (B, G), one pass.
- ``pix_squeeze_{nchw,cl}_{f32,f64}(x, w, pooled, y, B, C, Z, HW, tau)``: the whole block. Pass 1 reads x once
  for pooled = mean_hw(x) (B, C) (partial sums in T, totals in double) and every group's max and sum (into y and
  a scratch s); p = sigmoid(pooled @ w^T) (w (G, C) in x's dtype; ``pix_predict``); pass 2 selects and scales
  y in place (reading y and s, each 1/Z of x). ``pooled`` may be NULL (inference: the pool then lives in the
  scratch).
- ``pix_predict_{f32,f64}(pooled, w, p, B, C, G)``: that predictor alone (the CPU backward recomputes p with it).
- ``max_pool2d_nchw_{f32,f64}(x, y, planes, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw)``: ``F.max_pool2d`` of
  contiguous NCHW x (planes = B*C) for output sizes the caller computed (``kernels.max_pool2d``); per output row a
  vertical max of the window's rows, then the columns; NaN propagates as in PyTorch. One thread per share of planes.
- ``compress_omp_max_threads()``: the team size a pass would get now (0: built without OpenMP).

Every ``pix_*`` and ``max_pool2d_*`` function returns 0, or 1 if a scratch allocation failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable

__all__ = ["lib", "reset_for_tests", "SOURCE", "cache_root", "env_flag"]

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif
// Everything below is inlined into the workers (one thread's share of a pass, near the end), so each clone
// compiles it for its instruction set.
#define INL static inline __attribute__((always_inline))

// ---- Threads (OpenMP). A pass forks only for at least PAR_MIN elements of x; each thread of the team takes one
// contiguous share [a, b) of rows, positions or groups (`share`), the same for every call with that team size.
#define PAR_MIN 32768
#ifdef _OPENMP
static int max_threads() { return omp_get_max_threads(); }
static int team_rank() { return omp_get_thread_num(); }
static int team_size() { return omp_get_num_threads(); }
#else
static int max_threads() { return 1; }
static int team_rank() { return 0; }
static int team_size() { return 1; }
#endif
static void share(int64_t n, int64_t& a, int64_t& b) {
  const int64_t t = team_rank(), nt = team_size();
  a = n * t / nt;
  b = n * (t + 1) / nt;
}

// max(m, v) as PyTorch's max: a NaN wins (`v > m || v != v`); branch-free, a select, or for GCC vector types a
// blend. (`v > m ? v : m` alone kept a group's earlier value against a later NaN: a finite output for NaN input.)
template <typename T>
INL T nan_max(T m, T v) {
  return ((v > m) | (v != v)) ? v : m;
}

// Max (NaN wins, `nan_max`; the first value on ties) and in-order sum of one group's Z contiguous values.
template <typename T>
INL void group_max_sum(const T* __restrict__ v, int Z, T& m, T& s) {
  m = s = v[0];
  for (int k = 1; k < Z; ++k) {
    const T a = v[k];
    m = nan_max(m, a);
    s += a;
  }
}

#define ZDISPATCH(F, ...)                          \
  switch (Z) {                                     \
    case 1: F<T, 1>(__VA_ARGS__); break;           \
    case 2: F<T, 2>(__VA_ARGS__); break;           \
    case 4: F<T, 4>(__VA_ARGS__); break;           \
    case 8: F<T, 8>(__VA_ARGS__); break;           \
    default: F<T, 0>(__VA_ARGS__); break;          \
  }

// NCHW: x (B*G, Z, HW), y (B*G, HW); per row one branch, k outer and hw inner over L1-sized chunks of y.
template <typename T, int ZC>
INL void nchw_row(const T* __restrict__ xr, T* __restrict__ yr, int64_t HW, int Zr, bool pick, T pv) {
  const int Z = ZC > 0 ? ZC : Zr;
  const int64_t CH = 512;
  for (int64_t h0 = 0; h0 < HW; h0 += CH) {
    const int64_t n = HW - h0 < CH ? HW - h0 : CH;
    T* __restrict__ out = yr + h0;
    const T* __restrict__ x0 = xr + h0;
    for (int64_t i = 0; i < n; ++i) out[i] = x0[i];
    if (pick) {
      for (int k = 1; k < Z; ++k) {
        const T* __restrict__ xk = x0 + k * HW;
        for (int64_t i = 0; i < n; ++i) out[i] = nan_max(out[i], xk[i]);
      }
      for (int64_t i = 0; i < n; ++i) out[i] = pv * out[i];
    } else {
      for (int k = 1; k < Z; ++k) {
        const T* __restrict__ xk = x0 + k * HW;
        for (int64_t i = 0; i < n; ++i) out[i] += xk[i];
      }
      for (int64_t i = 0; i < n; ++i) out[i] = pv * (out[i] / (T)Z);
    }
  }
}

// Rows [a, b) of B*G.
template <typename T, int ZC>
INL void nchw_rows(const T* x, const T* p, T* y, int Z, int64_t HW, T tau, int64_t a, int64_t b) {
  for (int64_t r = a; r < b; ++r) nchw_row<T, ZC>(x + r * Z * HW, y + r * HW, HW, Z, p[r] < tau, p[r]);
}

// channels_last: x (B, HW, G, Z), y (B, HW, G); max and sum of each group in registers, selected per g.
template <typename T, int ZC>
INL void cl_pixel(const T* __restrict__ xp, T* __restrict__ yp, const T* __restrict__ pv, const T* __restrict__ pk,
                  int64_t G, int Zr) {
  const int Z = ZC > 0 ? ZC : Zr;
  for (int64_t g = 0; g < G; ++g) {
    T m, s;
    group_max_sum(xp + g * Z, Z, m, s);
    const T mean = s / (T)Z;
    const T r = pk[g] != (T)0 ? m : mean;
    yp[g] = pv[g] * r;
  }
}

// Positions [a, b) of B*HW; pk (B, G): 1 where p < tau.
template <typename T, int ZC>
INL void cl_positions(const T* x, const T* p, const T* pk, T* y, int64_t G, int Z, int64_t HW, int64_t a,
                      int64_t b) {
  for (int64_t n = a; n < b; ++n) {
    const int64_t bi = n / HW;
    cl_pixel<T, ZC>(x + n * G * Z, y + n * G, p + bi * G, pk + bi * G, G, Z);
  }
}

// ---- The PiX block (compress::pix_squeeze): pass 1, the predictor, pass 2.
// Pass 1 reads x once: pooled[b,c] = mean_hw x[b,c], y = max and s = sum of each group.
// Pass 2, given p (B, G): y = p < tau ? p * y : p * (s / Z), in place, reading y and s (each 1/Z of x).
template <typename T>
INL void acc16(double* __restrict__ lanes, const T* __restrict__ v, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += (double)v[i + j];
  for (; i < n; ++i) lanes[i & 15] += (double)v[i];
}

// Rows [a, b) of B*G (a row: one group's Z channels, whole; lanes: 16 * Z doubles of this thread).
template <typename T, int ZC>
INL void sq1_nchw(const T* x, T* pooled, T* ym, T* ys, double* lanes, int Zr, int64_t HW, int64_t a, int64_t b) {
  if (ZC > 0) {  // Z known: one read of each x vector updates max, sum and the pool lanes held in registers
    constexpr int Z = ZC > 0 ? ZC : 1;
    typedef T V __attribute__((vector_size(64)));
    constexpr int L = 64 / sizeof(T);
    for (int64_t r = a; r < b; ++r) {
      const T* __restrict__ xr = x + r * Z * HW;
      T* __restrict__ mo = ym + r * HW;
      T* __restrict__ so = ys + r * HW;
      double tot[Z];
      for (int k = 0; k < Z; ++k) tot[k] = 0.0;
      int64_t i = 0;
      while (i + L <= HW) {  // pool lanes in T for up to 32 vectors, then into double
        const int64_t nv = (HW - i) / L < 32 ? (HW - i) / L : 32;
        const int64_t stop = i + nv * L;
        V lk[Z];
        for (int k = 0; k < Z; ++k) lk[k] = V{} ;
        for (; i < stop; i += L) {
          V m, s;
          memcpy(&m, xr + i, sizeof(V));
          s = m;
          lk[0] += m;
          for (int k = 1; k < Z; ++k) {
            V v;
            memcpy(&v, xr + k * HW + i, sizeof(V));
            m = nan_max(m, v);
            s += v;
            lk[k] += v;
          }
          memcpy(mo + i, &m, sizeof(V));
          memcpy(so + i, &s, sizeof(V));
        }
        for (int k = 0; k < Z; ++k)
          for (int j = 0; j < L; ++j) tot[k] += (double)lk[k][j];
      }
      for (; i < HW; ++i) {
        T m = xr[i], s = xr[i];
        tot[0] += (double)xr[i];
        for (int k = 1; k < Z; ++k) {
          const T v = xr[k * HW + i];
          m = nan_max(m, v);
          s += v;
          tot[k] += (double)v;
        }
        mo[i] = m;
        so[i] = s;
      }
      for (int k = 0; k < Z; ++k) pooled[r * Z + k] = (T)(tot[k] / (double)HW);
    }
    return;
  }
  const int Z = Zr;  // any Z: chunks of y and s, k outer, pool lanes in memory
  const int64_t CH = 512;
  for (int64_t r = a; r < b; ++r) {
    const T* xr = x + r * Z * HW;
    for (int j = 0; j < Z * 16; ++j) lanes[j] = 0.0;
    for (int64_t h0 = 0; h0 < HW; h0 += CH) {
      const int64_t n = HW - h0 < CH ? HW - h0 : CH;
      const T* __restrict__ x0 = xr + h0;
      T* __restrict__ mo = ym + r * HW + h0;
      T* __restrict__ so = ys + r * HW + h0;
      for (int64_t i = 0; i < n; ++i) { mo[i] = x0[i]; so[i] = x0[i]; }
      acc16(lanes, x0, n);
      for (int k = 1; k < Z; ++k) {
        const T* __restrict__ xk = x0 + k * HW;
        for (int64_t i = 0; i < n; ++i) {
          const T v = xk[i];
          mo[i] = nan_max(mo[i], v);
          so[i] += v;
        }
        acc16(lanes + k * 16, xk, n);
      }
    }
    for (int k = 0; k < Z; ++k) {
      double t = 0.0;
      for (int j = 0; j < 16; ++j) t += lanes[k * 16 + j];
      pooled[r * Z + k] = (T)(t / (double)HW);
    }
  }
}

// Positions [a, b) of B*HW: each group's max and sum, and this thread's pool sums, part (B, C) in double (added
// to; per-channel sums of up to 32 positions of one sample in T first, in accT (C)).
template <typename T, int ZC>
INL void sq1_cl(const T* x, double* part, T* accT, T* ym, T* ys, int64_t G, int Zr, int64_t HW, int64_t a,
                int64_t b) {
  const int Z = ZC > 0 ? ZC : Zr;
  const int64_t C = G * Z;
  for (int64_t n0 = a; n0 < b;) {
    const int64_t bi = n0 / HW;
    int64_t n1 = (bi + 1) * HW < b ? (bi + 1) * HW : b;
    n1 = n1 - n0 > 32 ? n0 + 32 : n1;
    for (int64_t c = 0; c < C; ++c) accT[c] = (T)0;
    for (int64_t n = n0; n < n1; ++n) {
      const T* __restrict__ xp = x + n * C;
      T* __restrict__ mo = ym + n * G;
      T* __restrict__ so = ys + n * G;
      T* __restrict__ acc = accT;
      for (int64_t c = 0; c < C; ++c) acc[c] += xp[c];
      for (int64_t g = 0; g < G; ++g) {  // in registers: the worker cannot know that mo and so do not alias
        T m, s;
        group_max_sum(xp + g * Z, Z, m, s);
        mo[g] = m;
        so[g] = s;
      }
    }
    double* __restrict__ pb = part + bi * C;
    for (int64_t c = 0; c < C; ++c) pb[c] += (double)accT[c];
    n0 = n1;
  }
}

// Rows [a, b) of B*G.
template <typename T, int ZC>
INL void sq2_nchw(const T* p, T* ym, const T* ys, int Zr, int64_t HW, T tau, int64_t a, int64_t b) {
  const int Z = ZC > 0 ? ZC : Zr;
  for (int64_t r = a; r < b; ++r) {
    const T pv = p[r];
    T* __restrict__ m = ym + r * HW;
    const T* __restrict__ s = ys + r * HW;
    if (pv < tau) {
      for (int64_t i = 0; i < HW; ++i) m[i] = pv * m[i];
    } else {
      for (int64_t i = 0; i < HW; ++i) m[i] = pv * (s[i] / (T)Z);
    }
  }
}

// Positions [a, b) of B*HW; pk (B, G): 1 where p < tau.
template <typename T, int ZC>
INL void sq2_cl(const T* p, const T* pk, T* ym, const T* ys, int64_t G, int Zr, int64_t HW, int64_t a, int64_t b) {
  const int Z = ZC > 0 ? ZC : Zr;
  for (int64_t n = a; n < b; ++n) {
    const int64_t bi = n / HW;
    const T* __restrict__ pb = p + bi * G;
    const T* __restrict__ kb = pk + bi * G;
    T* __restrict__ m = ym + n * G;
    const T* __restrict__ s = ys + n * G;
    for (int64_t g = 0; g < G; ++g) {
      const T mean = s[g] / (T)Z;
      const T r = kb[g] != (T)0 ? m[g] : mean;
      m[g] = pb[g] * r;
    }
  }
}

// p = sigmoid(pooled @ w^T): pooled (B, C), w (G, C), p (B, G). A tile of NB samples x NG groups reads each of
// its NG w rows once for its NB samples (4 x 1 while 4 samples remain, then 1 x 8: at batch 1, 8 w rows streamed
// at once read weights that are not in L2 1.0-1.5x faster than one row at a time, on par with torch.mm;
// benchmarks/results/pix_cpu_predictor_tiles_ab.txt). Each dot product runs in 32 lanes of T whatever the tile
// (like a BLAS GEMV), summed and passed through the sigmoid in double: p[b, g] does not depend on the batch or
// the thread count.
template <typename T, int NB, int NG>
INL void predict_tile(const T* __restrict__ wg, const T* __restrict__ pooled, T* __restrict__ p, int64_t C,
                      int64_t G) {
  typedef T V __attribute__((vector_size(64)));
  constexpr int L = 64 / sizeof(T);
  V acc[NB][NG][2];
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < NG; ++g) acc[b][g][0] = acc[b][g][1] = V{};
  int64_t i = 0;
  for (; i + 2 * L <= C; i += 2 * L) {
    V w0[NG], w1[NG];
    for (int g = 0; g < NG; ++g) {
      memcpy(&w0[g], wg + g * C + i, sizeof(V));
      memcpy(&w1[g], wg + g * C + i + L, sizeof(V));
    }
    for (int b = 0; b < NB; ++b) {
      V a0, a1;
      memcpy(&a0, pooled + b * C + i, sizeof(V));
      memcpy(&a1, pooled + b * C + i + L, sizeof(V));
      for (int g = 0; g < NG; ++g) {
        acc[b][g][0] += w0[g] * a0;
        acc[b][g][1] += w1[g] * a1;
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < NG; ++g) {
      double z = 0.0;
      for (int j = 0; j < L; ++j) z += (double)acc[b][g][0][j] + (double)acc[b][g][1][j];
      for (int64_t t = i; t < C; ++t) z += (double)wg[g * C + t] * (double)pooled[b * C + t];
      p[b * G + g] = (T)(1.0 / (1.0 + exp(-z)));
    }
}

// Groups [a, b) of G, every sample.
template <typename T>
INL void predict_groups(const T* pooled, const T* w, T* p, int64_t B, int64_t C, int64_t G, int64_t a, int64_t b) {
  const int64_t B4 = B - B % 4;
  for (int64_t g = a; g < b; ++g)
    for (int64_t s = 0; s < B4; s += 4) predict_tile<T, 4, 1>(w + g * C, pooled + s * C, p + s * G + g, C, G);
  for (int64_t s = B4; s < B; ++s) {
    int64_t g = a;
    for (; g + 8 <= b; g += 8) predict_tile<T, 1, 8>(w + g * C, pooled + s * C, p + s * G + g, C, G);
    for (; g < b; ++g) predict_tile<T, 1, 1>(w + g * C, pooled + s * C, p + s * G + g, C, G);
  }
}

// ---- Max-pool, contiguous NCHW (kernels.max_pool2d). Per output row, the window's in-range input rows are reduced
// into one row (an elementwise max over W contiguous values, vectorised), then each output takes the max of its
// in-range columns of that row. A NaN anywhere in the window wins, as in PyTorch (`v > m || v != v`; -inf where a
// window holds nothing, which valid parameters never give).
struct PoolShape {
  int64_t H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw;
};


// Outputs [0, n) of one row from `col`: those in [lo, hi), whose windows lie inside the row, take no bounds checks;
// the window (KW, SW; dilation 1) is known at compile time for the common pools (0: read from q).
template <typename T, int KW, int SW>
INL void pool_row(const T* col, T* __restrict__ y, const PoolShape& q, int64_t lo, int64_t hi, int64_t n) {
  const int64_t kw = KW ? KW : q.kw, sw = SW ? SW : q.sw, dw = KW ? 1 : q.dw;
  auto edge = [&](int64_t ow) {
    T m = -(T)INFINITY;
    for (int64_t j = 0; j < kw; ++j) {
      const int64_t w = ow * sw - q.pw + j * dw;
      if (w >= 0 && w < q.W) m = nan_max(m, col[w]);
    }
    y[ow] = m;
  };
  for (int64_t ow = 0; ow < lo; ++ow) edge(ow);
  const T* __restrict__ c = col - q.pw;
  for (int64_t ow = lo; ow < hi; ++ow) {
    T m = c[ow * sw];
    for (int64_t j = 1; j < kw; ++j) m = nan_max(m, c[ow * sw + j * dw]);
    y[ow] = m;
  }
  for (int64_t ow = hi; ow < n; ++ow) edge(ow);
}

// Planes [a, b) of B*C; v: OH * W values of this thread. Pass 1 reduces each output row's in-range window rows
// into row oh of v (vector loops over W); pass 2 takes the outputs from v: one flat loop over the plane where every
// window lies inside its row and the rows tile v exactly (W == OW * SW: 2x2 pools of even maps), else per row.
template <typename T, int KW, int SW>
INL void pool_planes(const T* x, T* y, const PoolShape& q, T* __restrict__ v, int64_t a, int64_t b) {
  const int64_t sw = SW ? SW : q.sw, ext = (q.kw - 1) * q.dw;
  int64_t lo = (q.pw + sw - 1) / sw;  // first output whose window starts at or after column 0 (at most OW: a pad
  lo = lo < q.OW ? lo : q.OW;          // wider than the map, e.g. 5x5 / pad 2 on a 1-wide map, starts none inside)
  int64_t hi = q.W - ext + q.pw - 1 >= 0 ? (q.W - ext + q.pw - 1) / sw + 1 : 0;  // past the last one ending inside
  hi = hi < q.OW ? hi : q.OW;
  hi = hi > lo ? hi : lo;
  const bool flat = lo == 0 && hi == q.OW && q.pw == 0 && q.W == q.OW * sw;
  for (int64_t pl = a; pl < b; ++pl) {
    const T* xp = x + pl * q.H * q.W;
    T* yp = y + pl * q.OH * q.OW;
    for (int64_t oh = 0; oh < q.OH; ++oh) {
      T* __restrict__ vr = v + oh * q.W;
      bool any = false;
      for (int64_t i = 0; i < q.kh; ++i) {
        const int64_t h = oh * q.sh - q.ph + i * q.dh;
        if (h < 0 || h >= q.H) continue;
        const T* __restrict__ row = xp + h * q.W;
        if (!any) {
          for (int64_t w = 0; w < q.W; ++w) vr[w] = row[w];
        } else {
          for (int64_t w = 0; w < q.W; ++w) vr[w] = nan_max(vr[w], row[w]);
        }
        any = true;
      }
      if (!any)
        for (int64_t w = 0; w < q.W; ++w) vr[w] = -(T)INFINITY;
    }
    if (flat) {
      pool_row<T, KW, SW>(v, yp, q, 0, q.OH * q.OW, q.OH * q.OW);
    } else {
      for (int64_t oh = 0; oh < q.OH; ++oh) pool_row<T, KW, SW>(v + oh * q.W, yp + oh * q.OW, q, lo, hi, q.OW);
    }
  }
}

// ---- Workers: one thread's share of a pass. The compiler moves the body of a parallel region into a function of
// its own that does not inherit target_clones, so the vector code lives in these (cloned for float) functions,
// called from the regions below.
#define WORKERS(T, ATTR)                                                                                          \
  static ATTR void w_nchw(const T* x, const T* p, T* y, int Z, int64_t HW, T tau, int64_t a, int64_t b) {       \
    ZDISPATCH(nchw_rows, x, p, y, Z, HW, tau, a, b)                                                             \
  }                                                                                                             \
  static ATTR void w_cl(const T* x, const T* p, const T* pk, T* y, int64_t G, int Z, int64_t HW, int64_t a,     \
                        int64_t b) {                                                                            \
    ZDISPATCH(cl_positions, x, p, pk, y, G, Z, HW, a, b)                                                        \
  }                                                                                                             \
  static ATTR void w_sq1_nchw(const T* x, T* pooled, T* ym, T* ys, double* lanes, int Z, int64_t HW, int64_t a, \
                              int64_t b) {                                                                      \
    ZDISPATCH(sq1_nchw, x, pooled, ym, ys, lanes, Z, HW, a, b)                                                  \
  }                                                                                                             \
  static ATTR void w_sq1_cl(const T* x, double* part, T* accT, T* ym, T* ys, int64_t G, int Z, int64_t HW,      \
                            int64_t a, int64_t b) {                                                             \
    ZDISPATCH(sq1_cl, x, part, accT, ym, ys, G, Z, HW, a, b)                                                    \
  }                                                                                                             \
  static ATTR void w_sq2_nchw(const T* p, T* ym, const T* ys, int Z, int64_t HW, T tau, int64_t a, int64_t b) { \
    ZDISPATCH(sq2_nchw, p, ym, ys, Z, HW, tau, a, b)                                                            \
  }                                                                                                             \
  static ATTR void w_sq2_cl(const T* p, const T* pk, T* ym, const T* ys, int64_t G, int Z, int64_t HW,          \
                            int64_t a, int64_t b) {                                                             \
    ZDISPATCH(sq2_cl, p, pk, ym, ys, G, Z, HW, a, b)                                                            \
  }                                                                                                             \
  static ATTR void w_predict(const T* pooled, const T* w, T* p, int64_t B, int64_t C, int64_t G, int64_t a,     \
                             int64_t b) {                                                                       \
    predict_groups<T>(pooled, w, p, B, C, G, a, b);                                                             \
  }                                                                                                             \
  static ATTR void w_pool(const T* x, T* y, const PoolShape& q, T* v, int64_t a, int64_t b) {                   \
    if (q.kw == 2 && q.sw == 2 && q.dw == 1)                                                                    \
      pool_planes<T, 2, 2>(x, y, q, v, a, b);                                                                   \
    else if (q.kw == 3 && q.sw == 2 && q.dw == 1)                                                               \
      pool_planes<T, 3, 2>(x, y, q, v, a, b);                                                                   \
    else                                                                                                        \
      pool_planes<T, 0, 0>(x, y, q, v, a, b);                                                                   \
  }

// ZDISPATCH names T: the workers' element type.
#define T float
WORKERS(float, CLONES)
#undef T
#define T double
WORKERS(double, )
#undef T

// ---- The passes: parallel regions over the workers (a team of one below PAR_MIN elements of x).
template <typename T>
static T* flags_below(const T* p, int64_t n, T tau) {  // (T)1 where p < tau, else 0; NULL if out of memory
  T* pk = (T*)malloc(sizeof(T) * (n > 0 ? n : 1));
  if (pk)
    for (int64_t i = 0; i < n; ++i) pk[i] = p[i] < tau ? (T)1 : (T)0;
  return pk;
}

// f(a, b) on each thread's share [a, b) of n items: a team when `par`, else this thread alone.
template <typename F>
static void for_shares(int64_t n, bool par, F f) {
#pragma omp parallel if (par)
  {
    int64_t a, b;
    share(n, a, b);
    f(a, b);
  }
}

template <typename T>
static int nchw(const T* x, const T* p, T* y, int64_t B, int64_t G, int Z, int64_t HW, T tau) {
  for_shares(B * G, B * G * Z * HW >= PAR_MIN, [&](int64_t a, int64_t b) { w_nchw(x, p, y, Z, HW, tau, a, b); });
  return 0;
}

template <typename T>
static int cl(const T* x, const T* p, T* y, int64_t B, int64_t G, int Z, int64_t HW, T tau) {
  T* pk = flags_below(p, B * G, tau);
  if (!pk) return 1;
  for_shares(B * HW, B * G * Z * HW >= PAR_MIN, [&](int64_t a, int64_t b) { w_cl(x, p, pk, y, G, Z, HW, a, b); });
  free(pk);
  return 0;
}

// Pass 1. NCHW: threads take whole rows (each row's pool is one thread's). channels_last: threads take ranges of
// positions with pool sums of their own, (B, C) doubles each, added up in thread order after a barrier.
template <typename T>
static int sq1(bool cl, const T* x, T* pooled, T* ym, T* ys, int64_t B, int64_t C, int Z, int64_t HW, bool par) {
  const int64_t G = C / Z;
  const int64_t nt = par ? max_threads() : 1;
  const int64_t per = cl ? B * C + C : 16 * (int64_t)Z;  // doubles of scratch per thread
  double* work = (double*)malloc(sizeof(double) * nt * per);
  if (!work) return 1;
  if (cl) {
#pragma omp parallel if (par)
    {
      double* part = work + team_rank() * per;
      memset(part, 0, sizeof(double) * B * C);
      int64_t a, b;
      share(B * HW, a, b);
      w_sq1_cl(x, part, (T*)(part + B * C), ym, ys, G, Z, HW, a, b);
#pragma omp barrier
      const int n = team_size();
      share(B * C, a, b);
      for (int64_t i = a; i < b; ++i) {
        double s = 0.0;
        for (int t = 0; t < n; ++t) s += work[t * per + i];
        pooled[i] = (T)(s / (double)HW);
      }
    }
  } else {
    for_shares(B * G, par, [&](int64_t a, int64_t b) {
      w_sq1_nchw(x, pooled, ym, ys, work + team_rank() * per, Z, HW, a, b);
    });
  }
  free(work);
  return 0;
}

template <typename T>
static int sq2(bool cl, const T* p, T* ym, const T* ys, int64_t B, int64_t G, int Z, int64_t HW, T tau, bool par) {
  if (cl) {
    T* pk = flags_below(p, B * G, tau);
    if (!pk) return 1;
    for_shares(B * HW, par, [&](int64_t a, int64_t b) { w_sq2_cl(p, pk, ym, ys, G, Z, HW, a, b); });
    free(pk);
  } else {
    for_shares(B * G, par, [&](int64_t a, int64_t b) { w_sq2_nchw(p, ym, ys, Z, HW, tau, a, b); });
  }
  return 0;
}

template <typename T>
static void predict(const T* pooled, const T* w, T* p, int64_t B, int64_t C, int64_t G) {
  for_shares(G, G * C * B >= PAR_MIN && G > 1, [&](int64_t a, int64_t b) { w_predict(pooled, w, p, B, C, G, a, b); });
}

// The squeeze's scratch (the group sums, 1/Z of x) is kept per calling thread and reused while it is at most
// SCRATCH_KEEP bytes: a fresh multi-megabyte malloc may come from new pages, each faulted in on first touch.
// In whole PiX ResNet-50 forwards the difference is lost in how glibc hands pages to both models (A/B in
// benchmarks/results/pix_cpu_2threads_b8_scratch_*.json). Larger requests are allocated and freed per call.
#define SCRATCH_KEEP ((size_t)128 << 20)
static thread_local void* kept_scratch = NULL;
static thread_local size_t kept_bytes = 0;

// `bytes` of scratch, or NULL if out of memory; release it with scratch_release(ptr).
static void* scratch_get(size_t bytes) {
  if (bytes > SCRATCH_KEEP) return malloc(bytes);
  if (bytes > kept_bytes) {
    free(kept_scratch);
    kept_scratch = malloc(bytes);
    kept_bytes = kept_scratch ? bytes : 0;
  }
  return kept_scratch;
}

static void scratch_release(void* ptr) {
  if (ptr != kept_scratch) free(ptr);
}

// The whole block: pass 1, the predictor, pass 2 (s and p are scratch; pooled too where the caller passes NULL).
template <typename T>
static int squeeze(bool cl, const T* x, const T* w, T* pooled, T* y, int64_t B, int64_t C, int Z, int64_t HW,
                   T tau) {
  const int64_t G = C / Z;
  const bool par = B * C * HW >= PAR_MIN;
  T* s = (T*)scratch_get(sizeof(T) * (B * G * HW + B * G + (pooled ? 0 : B * C)));
  if (!s) return 1;
  T* p = s + B * G * HW;
  if (!pooled) pooled = p + B * G;
  int err = sq1<T>(cl, x, pooled, y, s, B, C, Z, HW, par);
  if (!err) {
    predict<T>(pooled, w, p, B, C, G);
    err = sq2<T>(cl, p, y, s, B, G, Z, HW, tau, par);
  }
  scratch_release(s);
  return err;
}

// The pool over `planes` planes; 1 if out of memory (OH * W values of scratch per thread).
template <typename T>
static int max_pool(const T* x, T* y, int64_t planes, const PoolShape& q) {
  const bool par = planes > 1 && planes * q.H * q.W >= PAR_MIN;
  T* v = (T*)malloc(sizeof(T) * q.OH * q.W * (par ? max_threads() : 1));
  if (!v) return 1;
  for_shares(planes, par, [&](int64_t a, int64_t b) { w_pool(x, y, q, v + team_rank() * q.OH * q.W, a, b); });
  free(v);
  return 0;
}

// Entry points (their workers are the target_clones: AVX-512, AVX2 and baseline x86-64 for float32; float64,
// for tests and references, only in the baseline build).
#define ENTRIES(SUF, T)                                                                                           \
  int pix_nchw_##SUF(const T* x, const T* p, T* y, int64_t B, int64_t G, int64_t Z, int64_t HW, double tau) {   \
    return nchw<T>(x, p, y, B, G, (int)Z, HW, (T)tau);                                                          \
  }                                                                                                             \
  int pix_cl_##SUF(const T* x, const T* p, T* y, int64_t B, int64_t G, int64_t Z, int64_t HW, double tau) {     \
    return cl<T>(x, p, y, B, G, (int)Z, HW, (T)tau);                                                            \
  }                                                                                                             \
  int pix_squeeze_nchw_##SUF(const T* x, const T* w, T* pooled, T* y, int64_t B, int64_t C, int64_t Z,          \
                             int64_t HW, double tau) {                                                          \
    return squeeze<T>(false, x, w, pooled, y, B, C, (int)Z, HW, (T)tau);                                        \
  }                                                                                                             \
  int pix_squeeze_cl_##SUF(const T* x, const T* w, T* pooled, T* y, int64_t B, int64_t C, int64_t Z,            \
                           int64_t HW, double tau) {                                                            \
    return squeeze<T>(true, x, w, pooled, y, B, C, (int)Z, HW, (T)tau);                                         \
  }                                                                                                             \
  int pix_predict_##SUF(const T* pooled, const T* w, T* p, int64_t B, int64_t C, int64_t G) {                   \
    predict<T>(pooled, w, p, B, C, G);                                                                          \
    return 0;                                                                                                   \
  }                                                                                                             \
  int max_pool2d_nchw_##SUF(const T* x, T* y, int64_t planes, int64_t H, int64_t W, int64_t OH, int64_t OW,      \
                            int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh, \
                            int64_t dw) {                                                                       \
    return max_pool<T>(x, y, planes, PoolShape{H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw});                  \
  }

extern "C" {
ENTRIES(f32, float)
ENTRIES(f64, double)
// The team size a pass gets (omp_get_max_threads(): torch.set_num_threads where the runtime is torch's); 0
// without OpenMP.
int compress_omp_max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 0;
#endif
}
}
"""

# -fno-trapping-math lets GCC turn the per-group select into vector blends (results are unchanged: no fast-math).
# -fopenmp: the passes run on torch's OpenMP threads (module docstring); SERIAL_FLAGS where that cannot build or load.
FLAGS = ["-O3", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
SERIAL_FLAGS = [f for f in FLAGS if f != "-fopenmp"]
_PTR, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {}  # argtypes; every function returns an int (pix_*: 0, or 1 when out of memory)
for _t in ("f32", "f64"):
    for _l in ("nchw", "cl"):
        SIGNATURES[f"pix_{_l}_{_t}"] = [_PTR] * 3 + [_I64] * 4 + [_F64]  # x, p, y, B, G, Z, HW, tau
        SIGNATURES[f"pix_squeeze_{_l}_{_t}"] = [_PTR] * 4 + [_I64] * 4 + [_F64]  # x, w, pooled, y, B, C, Z, HW, tau
    SIGNATURES[f"pix_predict_{_t}"] = [_PTR] * 3 + [_I64] * 3  # pooled, w, p, B, C, G
    # x, y, planes, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw
    SIGNATURES[f"max_pool2d_nchw_{_t}"] = [_PTR] * 2 + [_I64] * 13
SIGNATURES["compress_omp_max_threads"] = []  # the threads a pass may use (0: built without OpenMP)

_lock = threading.Lock()
_state: dict[str, object] = {}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """Whether the on/off environment variable `name` is set: 1/true/yes/on, or unset/empty/0/false/no/off (any
    case); ValueError naming it for another value (``=false`` turned the kernels off)."""
    value = os.environ.get(name, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{name}={os.environ[name]!r}: give 1 (or true, yes, on) to set it, 0 or nothing to leave it "
                         "unset")
    return value in _TRUE


_START_DIR = os.getcwd()  # the working directory at import: where the command was started


def cache_root() -> str:
    """The kernels' cache folder: ``$COMPRESS_KERNELS_CACHE`` (``~`` expanded; a relative path against the working
    directory the process had when it imported the kernels, so that a run which changes directory, such as
    train.py with ``hydra.job.chdir=true``, does not build a cache in each run dir) or ``~/.cache/compress_kernels``."""
    root = os.environ.get("COMPRESS_KERNELS_CACHE") or os.path.join("~", ".cache", "compress_kernels")
    return os.path.join(_START_DIR, os.path.expanduser(root))


def _compiler() -> tuple[list[str] | None, str]:
    """(the compiler's command: its path, then any words after it in ``$CXX`` such as ``ccache g++``'s compiler;
    and a warning to give where ``$CXX`` names no executable and another compiler stands in, else ""), or (None,
    why there is none)."""
    try:
        words = shlex.split(os.environ.get("CXX", ""))
    except ValueError:  # an unclosed quote: no command, as a CXX that names no executable
        words = [os.environ["CXX"]]
    given = shutil.which(words[0]) if words else None
    if given:
        return [given, *words[1:]], ""
    found = next((shutil.which(c) for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if words:
        cxx = os.environ["CXX"]
        if found is None:
            return None, f"CXX={cxx!r} is not an executable compiler, and no c++, g++ or clang++ is on PATH"
        return [found], f"compress kernels: CXX={cxx!r} is not an executable compiler; using {found}"
    return ([found], "") if found else (None, "no C++ compiler found (c++, g++ or clang++ on PATH); set CXX")


class _CompileError(RuntimeError):
    pass


class _NoCompiler(RuntimeError):
    pass


def _path(flags: list[str]) -> str:
    """The cached library's path: named by a hash of the source, the flags and the machine. Not of the compiler: a
    library prebuilt by ``python -m kernels build`` (a container image) loads where no compiler, or another one, is
    found at run time; to build it again with another compiler, delete it."""
    tag = hashlib.sha256("\0".join([SOURCE, *flags, platform.machine(), platform.system()]).encode())
    return os.path.join(cache_root(), "cpu", f"compress_cpu_{tag.hexdigest()[:16]}.so")


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _intact(path: str) -> bool:
    """Whether `path` is the library as built: its SHA-256 as recorded beside it (``.sha256``, written with it),
    and on Linux a whole ELF file (its program and section header tables inside it). A library damaged on disk
    (truncated, or a zeroed tail) makes dlopen crash the process (SIGBUS, SIGSEGV), past any Python error
    handling."""
    try:
        with open(path + ".sha256") as f:
            if f.read().strip() != _digest(path):
                return False
        with open(path, "rb") as f:
            head, size = f.read(64), os.fstat(f.fileno()).st_size
    except OSError:  # (a library without its digest: built by a version before it)
        return False
    if platform.system() != "Linux":
        return True
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return False
    order = "<" if head[5] == 1 else ">"
    if head[4] == 2:  # ELF64
        if len(head) < 64:
            return False
        phoff, shoff = struct.unpack_from(order + "QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54)
    else:
        phoff, shoff = struct.unpack_from(order + "II", head, 28)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 42)
    return phoff + phnum * phentsize <= size and shoff + shnum * shentsize <= size


def _sweep_stale_builds(d: str, age_s: float = 3600) -> None:
    """Remove build folders (tmp*) older than `age_s` that killed processes left in the cache folder `d`."""
    for entry in os.scandir(d):
        with contextlib.suppress(OSError):
            if entry.name.startswith("tmp") and entry.is_dir() and time.time() - entry.stat().st_mtime > age_s:
                shutil.rmtree(entry.path, ignore_errors=True)


def _build(flags: list[str], compiler: Callable[[], list[str]]) -> str:
    """The path of the intact cached library built with `flags`, built first where there is none: with the
    command `compiler()` gives (called only then; it raises _NoCompiler where there is none). A compile error is
    remembered in a ``.failed`` file beside the library, with the compiler's command: later processes with that
    command raise it again instead of compiling (15-50 s) until the file is deleted."""
    so = _path(flags)
    if os.path.exists(so):
        if _intact(so):
            return so
        with contextlib.suppress(OSError):
            os.remove(so)  # damaged on disk: built again below
    cxx = compiler()
    failed = so + ".failed"
    if os.path.exists(failed):
        with open(failed) as f:
            command, _, error = f.read().partition("\n")
        if command == shlex.join(cxx):
            raise _CompileError(error.strip() or "an earlier build failed")
    d = os.path.dirname(so)
    os.makedirs(d, exist_ok=True)
    _sweep_stale_builds(d)
    with tempfile.TemporaryDirectory(dir=d) as tmp:  # build privately, then rename: safe with parallel processes
        src, out = os.path.join(tmp, "kernels.cpp"), os.path.join(tmp, "kernels.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        kind = "" if "-fopenmp" in flags else " without OpenMP"
        print(f"compress kernels: compiling the C++ CPU kernels{kind} with {shlex.join(cxx)} into {d} (first use only, a few "
              "seconds) ...", file=sys.stderr, flush=True)
        r = subprocess.run([*cxx, *flags, "-o", out, src], capture_output=True, text=True, timeout=300)
        if r.returncode != 0 or not os.path.isfile(out):
            lines = (r.stderr or r.stdout or f"exit status {r.returncode}, no library written").strip().splitlines()
            error = f"{shlex.join(cxx)} failed: " + next((ln for ln in lines if "error" in ln), lines[-1])[:300]
            if r.returncode < 0 or any("Killed" in ln for ln in lines):  # gcc's and clang's words: not remembered
                raise RuntimeError(error)
            with contextlib.suppress(OSError), open(failed, "w") as f:  # (unwritable: only not remembered)
                f.write(f"{shlex.join(cxx)}\n{error}")
            raise _CompileError(error)
        with open(out, "rb") as f:
            os.fsync(f.fileno())  # on disk before it gets its name: a crash leaves no truncated library behind
        with open(so + ".sha256", "w") as f:  # (parallel builds: a mismatch later only means one more build)
            f.write(_digest(out))
            f.flush()
            os.fsync(f.fileno())
        os.replace(out, so)
    return so


def _load(flags: list[str], compiler: Callable[[], list[str]]) -> ctypes.CDLL:
    handle = ctypes.CDLL(_build(flags, compiler))
    for name, args in SIGNATURES.items():
        fn = getattr(handle, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return handle


def _retry_hint(error: Exception) -> str:
    """How to make the next process try again after `error`: the ``.failed`` files to delete (a remembered
    compile error), else ""."""
    failed = [f for f in (_path(FLAGS) + ".failed", _path(SERIAL_FLAGS) + ".failed") if os.path.exists(f)]
    remembered = isinstance(error, (_CompileError, _NoCompiler))  # (no compiler: a remembered failure explains why)
    return f" (delete {' and '.join(failed)} to try again)" if remembered and failed else ""


def _load_any(notes: list[str]) -> ctypes.CDLL:
    """The OpenMP build, else the serial one (a note in `notes`: single-threaded kernels); raises if neither
    loads. The compiler is looked for only where a library must be built (any warning about it goes to
    `notes`)."""
    found: list[tuple[list[str] | None, str]] = []

    def compiler() -> list[str]:
        if not found:
            found.append(_compiler())
            if found[0][0] is not None and found[0][1]:
                notes.append(found[0][1])
        cxx, why = found[0]
        if cxx is None:
            raise _NoCompiler(why)
        return cxx

    try:
        return _load(FLAGS, compiler)
    except Exception as e:  # noqa: BLE001 - no OpenMP (compiler or runtime): build without
        omp_error = e
    handle = _load(SERIAL_FLAGS, compiler)
    so = _path(FLAGS)
    retry = _retry_hint(omp_error) or (f" (delete {so} to build it again)" if os.path.exists(so) else "")  # (built, but it does not load)
    why = f"the OpenMP build is not in the cache, and {omp_error}" if isinstance(omp_error, _NoCompiler) else omp_error
    notes.append(f"compress kernels: the C++ CPU kernels are built without OpenMP ({why}); they run "
                 f"single-threaded{retry}.")
    return handle


_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENOSPC, errno.EDQUOT)  # the cache's


def lib() -> ctypes.CDLL | None:
    """The loaded library (its functions with argtypes set), or None (one warning) where it cannot be built. The
    outcome is kept before any warning is given: under ``-W error`` the warning raises once, and later calls
    return the kept outcome instead of building again."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    notes: list[str] = []
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        handle = None
        if not env_flag("COMPRESS_KERNELS_NO_CPU"):  # set: the PyTorch path, no warning
            try:
                handle = _load_any(notes)
            except Exception as e:  # noqa: BLE001 - any build or load failure means: fall back, with one warning
                unwritable = isinstance(e, OSError) and e.errno in _UNWRITABLE  # (not a library that fails to load)
                why = str(e) if isinstance(e, _NoCompiler) else f"{type(e).__name__}: {e}{_retry_hint(e)}"
                notes.append(f"compress kernels: the C++ CPU kernels are unavailable ({why}"
                             + ("; COMPRESS_KERNELS_CACHE=<a writable folder> moves the cache, `python -m kernels "
                                "build` prebuilds it" if unwritable else "")
                             + "); CPU tensors use the slower PyTorch path.")
        _state["lib"] = handle
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=3)
    return handle


def reset_for_tests() -> None:
    """Forget the loaded library (tests only; the cached file stays)."""
    with _lock:
        _state.clear()
