// Scaled dot-product attention on the CPU, flash style: the reference for
// xla_ext/cuda/attention.cu (float32, float64, and bfloat16 with float32 arithmetic).
// Handler contract and the formulas: common/attention.h.
//
// Forward, per (batch, head) and block of query rows: an online softmax over blocks of keys
// (running max m, running sum l, unnormalised output acc rescaled by exp(m_old - m_new) when
// the max grows), so no [Tq, Tk] score matrix is ever formed; it saves lse = m + log(l).
// Backward recomputes the probabilities from q, k and lse block by block, as the GPU will.
// Grouped-query attention (k, v with KV < H heads): each key/value head is gathered once and
// serves its G = H / KV query heads in turn; the backward sums dk, dv over them in place, in
// query-head order, and writes them once.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/attention.h"
#include "common/bf16.h"
#include "common/cpu_util.h"
#include "common/ffi_util.h"
#include "common/registry.h"

namespace blujax {
namespace {

// Block sizes of the tiling; any T works (the last block of each axis is partial).
constexpr int64_t kBlockQ = 32;
constexpr int64_t kBlockK = 64;

// One (batch, head) slice of a [B, T, N, D] tensor (N: the tensor's heads, H for q, KV for k
// and v), copied to a contiguous [T, D] array in compute precision (the head axis is strided
// in memory).
template <typename T, typename S>
void Gather(const T* x, int64_t b, int64_t h, int64_t len, int64_t heads, int64_t head_dim,
            S* dst) {
  for (int64_t t = 0; t < len; ++t) {
    const int64_t off = ((b * len + t) * heads + h) * head_dim;
    for (int64_t c = 0; c < head_dim; ++c) dst[t * head_dim + c] = Load(x, off + c);
  }
}

// The reverse, into rows `token_stride` elements apart: N * D, or 3 * H * D for one of the
// three thirds of a [B, T, 3, H, D] gradient.
template <typename T, typename S>
void Scatter(const S* src, int64_t b, int64_t h, int64_t len, const AttentionDims& d,
             int64_t token_stride, T* x) {
  for (int64_t t = 0; t < len; ++t) {
    const int64_t off = (b * len + t) * token_stride + h * d.head_dim;
    for (int64_t c = 0; c < d.head_dim; ++c) Store(x, off + c, src[t * d.head_dim + c]);
  }
}

template <typename S>
S Dot(const S* a, const S* b, int64_t n) {
  S s = 0;
  for (int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}

// How many keys of the block starting at k0 (of nk keys) query row qi attends to.
inline int64_t KeysInBlock(bool causal, int64_t qi, int64_t k0, int64_t nk) {
  return causal ? std::min(nk, qi - k0 + 1) : nk;
}

template <typename T>
void AttentionFwdImpl(const T* q, const T* k, const T* v, T* out,
                      typename Compute<T>::type* lse, const AttentionDims& d, bool causal,
                      double scale_attr) {
  using S = typename Compute<T>::type;
  const int64_t tq = d.q_len, tk = d.kv_len, dh = d.head_dim;
  const S scale = static_cast<S>(scale_attr);  // exact for float64, rounded to float otherwise
  const S neg_inf = -std::numeric_limits<S>::infinity();
  // Per call, so XLA may run several calls at once.
  std::vector<S> qh(tq * dh), kh(tk * dh), vh(tk * dh), oh(tq * dh);
  std::vector<S> acc(kBlockQ * dh), m(kBlockQ), l(kBlockQ), s(kBlockK);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.heads; ++h) {
      // Query head h attends to key/value head h / G, gathered once for its group.
      if (h % d.group == 0) {
        Gather(k, b, h / d.group, tk, d.kv_heads, dh, kh.data());
        Gather(v, b, h / d.group, tk, d.kv_heads, dh, vh.data());
      }
      Gather(q, b, h, tq, d.heads, dh, qh.data());
      for (int64_t q0 = 0; q0 < tq; q0 += kBlockQ) {
        const int64_t nq = std::min(kBlockQ, tq - q0);
        std::fill(m.begin(), m.end(), neg_inf);
        std::fill(l.begin(), l.end(), S(0));
        std::fill(acc.begin(), acc.end(), S(0));
        // Causal: keys past this block's last query are masked for every row of it.
        const int64_t k_end = causal ? q0 + nq : tk;
        for (int64_t k0 = 0; k0 < k_end; k0 += kBlockK) {
          const int64_t nk = std::min(kBlockK, k_end - k0);
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t qi = q0 + i, nj = KeysInBlock(causal, qi, k0, nk);
            if (nj <= 0) continue;
            S block_max = neg_inf;
            for (int64_t j = 0; j < nj; ++j) {
              s[j] = scale * Dot(&qh[qi * dh], &kh[(k0 + j) * dh], dh);
              block_max = std::max(block_max, s[j]);
            }
            const S m_new = std::max(m[i], block_max);
            const S correction = std::exp(m[i] - m_new);  // 0 on the row's first block
            S* a = &acc[i * dh];
            S sum = l[i] * correction;
            for (int64_t c = 0; c < dh; ++c) a[c] *= correction;
            for (int64_t j = 0; j < nj; ++j) {
              const S p = std::exp(s[j] - m_new);
              sum += p;
              const S* vj = &vh[(k0 + j) * dh];
              for (int64_t c = 0; c < dh; ++c) a[c] += p * vj[c];
            }
            m[i] = m_new;
            l[i] = sum;
          }
        }
        for (int64_t i = 0; i < nq; ++i) {
          const S inv = S(1) / l[i];
          for (int64_t c = 0; c < dh; ++c) oh[(q0 + i) * dh + c] = acc[i * dh + c] * inv;
          lse[(b * d.heads + h) * tq + q0 + i] = m[i] + std::log(l[i]);
        }
      }
      Scatter(oh.data(), b, h, tq, d, d.heads * d.head_dim, out);
    }
  }
}

template <typename T>
void AttentionBwdImpl(const T* q, const T* k, const T* v, const T* out,
                      const typename Compute<T>::type* lse, const T* dout,
                      const typename Compute<T>::type* dlse, T* dq, T* dk, T* dv,
                      typename Compute<T>::type* delta_out, int64_t q_grad_stride,
                      int64_t kv_grad_stride, const AttentionDims& d, bool causal,
                      double scale_attr) {
  using S = typename Compute<T>::type;
  const int64_t tq = d.q_len, tk = d.kv_len, dh = d.head_dim;
  const S scale = static_cast<S>(scale_attr);  // exact for float64, rounded to float otherwise
  std::vector<S> qh(tq * dh), kh(tk * dh), vh(tk * dh), oh(tq * dh), doh(tq * dh);
  std::vector<S> dqh(tq * dh), dkh(tk * dh), dvh(tk * dh);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.heads; ++h) {
      // Key/value head h / G: gathered, and its sums zeroed, at the group's first query head;
      // dk and dv written after its last.
      const int64_t kvh = h / d.group;
      if (h % d.group == 0) {
        Gather(k, b, kvh, tk, d.kv_heads, dh, kh.data());
        Gather(v, b, kvh, tk, d.kv_heads, dh, vh.data());
        std::fill(dkh.begin(), dkh.end(), S(0));
        std::fill(dvh.begin(), dvh.end(), S(0));
      }
      Gather(q, b, h, tq, d.heads, dh, qh.data());
      Gather(out, b, h, tq, d.heads, dh, oh.data());
      Gather(dout, b, h, tq, d.heads, dh, doh.data());
      std::fill(dqh.begin(), dqh.end(), S(0));
      const S* row_lse = &lse[(b * d.heads + h) * tq];
      const S* row_dlse = &dlse[(b * d.heads + h) * tq];
      // D_i - dlse_i: the part of dS_ij = P_ij (dP_ij - D_i + dlse_i) that is the same for
      // every key of row i. It is an output of the contract (the GPU's scratch), so it is
      // computed into that buffer here too.
      S* delta = &delta_out[(b * d.heads + h) * tq];
      for (int64_t i = 0; i < tq; ++i)
        delta[i] = Dot(&doh[i * dh], &oh[i * dh], dh) - row_dlse[i];
      // Key blocks outside, as the GPU kernel will do it: dk, dv of a block stay in one place
      // while the query blocks stream past.
      for (int64_t k0 = 0; k0 < tk; k0 += kBlockK) {
        const int64_t nk = std::min(kBlockK, tk - k0);
        const int64_t q_begin = causal ? k0 / kBlockQ * kBlockQ : 0;  // earlier rows see none
        for (int64_t q0 = q_begin; q0 < tq; q0 += kBlockQ) {
          const int64_t nq = std::min(kBlockQ, tq - q0);
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t qi = q0 + i, nj = KeysInBlock(causal, qi, k0, nk);
            const S* qrow = &qh[qi * dh];
            const S* dorow = &doh[qi * dh];
            S* dqrow = &dqh[qi * dh];
            for (int64_t j = 0; j < nj; ++j) {
              const int64_t kj = k0 + j;
              const S p = std::exp(scale * Dot(qrow, &kh[kj * dh], dh) - row_lse[qi]);
              const S dp = Dot(dorow, &vh[kj * dh], dh);
              const S ds = scale * p * (dp - delta[qi]);
              S* dkrow = &dkh[kj * dh];
              S* dvrow = &dvh[kj * dh];
              const S* krow = &kh[kj * dh];
              for (int64_t c = 0; c < dh; ++c) {
                dqrow[c] += ds * krow[c];
                dkrow[c] += ds * qrow[c];
                dvrow[c] += p * dorow[c];
              }
            }
          }
        }
      }
      Scatter(dqh.data(), b, h, tq, d, q_grad_stride, dq);
      if (h % d.group == d.group - 1) {
        Scatter(dkh.data(), b, kvh, tk, d, kv_grad_stride, dk);
        Scatter(dvh.data(), b, kvh, tk, d, kv_grad_stride, dv);
      }
    }
  }
}

ffi::Error AttentionFwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                        ffi::Result<ffi::AnyBuffer> counter, bool causal, double scale) {
  const char* op = "blujax_attention_fwd";
  AttentionDims d;
  BLUJAX_RETURN_IF_ERROR(CheckAttentionFwd(op, /*allow_f64=*/true, q, k, v, *out, *lse, *counter,
                                           causal, scale, &d));
  return DispatchFloat(q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using S = typename Compute<T>::type;
    AttentionFwdImpl<T>(In<T>(q), In<T>(k), In<T>(v), Out<T>(out), Out<S>(lse), d, causal,
                        scale);
  });
}

// dq, dk, dv at their pointers, rows of dq q_grad_stride apart and of dk, dv kv_grad_stride
// (both handlers below).
ffi::Error AttentionBwdImpl(const char* op, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                            ffi::AnyBuffer dout, ffi::AnyBuffer dlse, void* dq, void* dk,
                            void* dv, int64_t q_grad_stride, int64_t kv_grad_stride,
                            ffi::AnyBuffer* delta, const AttentionDims& d, bool causal,
                            double scale) {
  return DispatchFloat(q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    using S = typename Compute<T>::type;
    AttentionBwdImpl<T>(In<T>(q), In<T>(k), In<T>(v), In<T>(out), In<S>(lse), In<T>(dout),
                        In<S>(dlse), static_cast<T*>(dq), static_cast<T*>(dk),
                        static_cast<T*>(dv), static_cast<S*>(delta->untyped_data()),
                        q_grad_stride, kv_grad_stride, d, causal, scale);
  });
}

ffi::Error AttentionBwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                        ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> delta,
                        bool causal, double scale, bool sum_dq) {
  const char* op = "blujax_attention_bwd";
  AttentionDims d;
  // sum_dq is the GPU's choice of kernels; here it only sets the workspace's size.
  BLUJAX_RETURN_IF_ERROR(CheckAttentionBwd(op, /*allow_f64=*/true, q, k, v, out, lse, dout, dlse,
                                           *dq, *dk, *dv, *delta, causal, scale, sum_dq, &d));
  return AttentionBwdImpl(op, q, k, v, out, lse, dout, dlse, dq->untyped_data(),
                          dk->untyped_data(), dv->untyped_data(), d.heads * d.head_dim,
                          d.kv_heads * d.head_dim, &*delta, d, causal, scale);
}

ffi::Error AttentionQkvBwd(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer out, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                           ffi::AnyBuffer dlse, ffi::Result<ffi::AnyBuffer> dqkv,
                           ffi::Result<ffi::AnyBuffer> delta, bool causal, double scale,
                           bool sum_dq) {
  const char* op = "blujax_attention_qkv_bwd";
  AttentionDims d;
  BLUJAX_RETURN_IF_ERROR(CheckAttentionQkvBwd(op, /*allow_f64=*/true, q, k, v, out, lse, dout,
                                              dlse, *dqkv, *delta, causal, scale, sum_dq, &d));
  // dq, dk, dv are the thirds of each token's row of 3 * H * D elements.
  const int64_t third = d.heads * d.head_dim * ffi::ByteWidth(q.element_type());
  char* base = static_cast<char*>(dqkv->untyped_data());
  return AttentionBwdImpl(op, q, k, v, out, lse, dout, dlse, base, base + third,
                          base + 2 * third, 3 * d.heads * d.head_dim, 3 * d.heads * d.head_dim,
                          &*delta, d, causal, scale);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAttentionFwd, AttentionFwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // q [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // k [B, Tk, KV, D], KV dividing H
                           .Arg<ffi::AnyBuffer>()   // v [B, Tk, KV, D]
                           .Ret<ffi::AnyBuffer>()   // out [B, Tq, H, D]
                           .Ret<ffi::AnyBuffer>()   // lse [B, H, Tq] f32 (f64 for f64)
                           .Ret<ffi::AnyBuffer>()   // counter [1] s32, the GPU's scratch
                           .Attr<bool>("causal")
                           .Attr<double>("scale"));  // f64: exact for f64 inputs, a float otherwise

XLA_FFI_DEFINE_HANDLER(kAttentionBwd, AttentionBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // q [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // k [B, Tk, KV, D], KV dividing H
                           .Arg<ffi::AnyBuffer>()   // v [B, Tk, KV, D]
                           .Arg<ffi::AnyBuffer>()   // out [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // lse [B, H, Tq]
                           .Arg<ffi::AnyBuffer>()   // dout [B, Tq, H, D]
                           .Arg<ffi::AnyBuffer>()   // dlse [B, H, Tq], cotangent of lse
                           .Ret<ffi::AnyBuffer>()   // dq [B, Tq, H, D]
                           .Ret<ffi::AnyBuffer>()   // dk [B, Tk, KV, D], summed over each group
                           .Ret<ffi::AnyBuffer>()   // dv [B, Tk, KV, D]
                           .Ret<ffi::AnyBuffer>()   // delta: rowsum(dout out) - dlse, [B, H, Tq]
                           .Attr<bool>("causal")
                           .Attr<double>("scale")   // f64: exact for f64 inputs, a float otherwise
                           .Attr<bool>("sum_dq"));  // delta has the GPU's dQ room (left as is)

XLA_FFI_DEFINE_HANDLER(kAttentionQkvBwd, AttentionQkvBwd,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()   // q [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // k [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // v [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // out [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // lse [B, H, T]
                           .Arg<ffi::AnyBuffer>()   // dout [B, T, H, D]
                           .Arg<ffi::AnyBuffer>()   // dlse [B, H, T], cotangent of lse
                           .Ret<ffi::AnyBuffer>()   // dqkv [B, T, 3, H, D]
                           .Ret<ffi::AnyBuffer>()   // delta: rowsum(dout out) - dlse, [B, H, T]
                           .Attr<bool>("causal")
                           .Attr<double>("scale")   // f64: exact for f64 inputs, a float otherwise
                           .Attr<bool>("sum_dq"));  // delta has the GPU's dQ room (left as is)

BLUJAX_REGISTER(blujax_attention_fwd, kAttentionFwd);
BLUJAX_REGISTER(blujax_attention_bwd, kAttentionBwd);
BLUJAX_REGISTER(blujax_attention_qkv_bwd, kAttentionQkvBwd);

}  // namespace blujax
