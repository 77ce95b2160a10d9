// The attention handler contract, shared by xla_ext/cpu/attention.cc and
// xla_ext/cuda/attention.cu (the same on both platforms).
//
// blujax_attention_fwd  (q, k, v)                         -> (out, lse, counter)
// blujax_attention_bwd  (q, k, v, out, lse, dout, dlse)   -> (dq, dk, dv, delta)
// blujax_attention_qkv_bwd  (the same operands)            -> (dqkv, delta)
// attributes: causal (bool), scale (float64, finite and > 0; each kernel takes it at its own
// precision: double for float64 inputs, float for float32 and bfloat16); the two backward
// targets also sum_dq (bool, below)
//
// q, out, dout, dq are [B, Tq, H, D]; k, v, dk, dv are [B, Tk, KV, D] (the layout a fused QKV
// projection gives without a transpose), all of one float dtype. KV divides H: KV == H is
// multi-head attention, KV < H grouped-query attention, where query head h attends to
// key/value head h / G, G = H / KV (Hugging Face's repeat_kv order); no kernel makes repeated
// copies of k and v, and dk, dv of a key/value head are the sums over its G query heads.
// lse, dlse and delta are [B, H, Tq], float32 (float64 for float64 inputs). With
// s = scale * q k^T per (b, h), k and v of head h / G:
//   lse_i = log(sum_j exp(s_ij))    out_i = sum_j exp(s_ij - lse_i) v_j
// causal masks keys j > i and needs Tq == Tk (every row then keeps at least key 0); the
// non-causal form allows Tq != Tk (ring attention's off-diagonal blocks).
// Backward, with P = exp(s - lse), dP = dout v^T and delta_i = sum_d dout_id out_id - dlse_i:
//   dS = P * (dP - delta_i)    dq = scale dS k    dk = scale dS^T q    dv = P^T dout
// (dk and dv summed over the G query heads of the key/value head.)
// (dlse enters because d lse_i / d s_ij = P_ij; ring attention merges partial results through
// lse, so its gradient flows back through it.) delta is an output only because the GPU needs
// it as scratch between its kernels and handlers never allocate; callers drop it.
// sum_dq asks the backward to sum dQ in its dK/dV kernel (float32 sums in a varying order, so
// not bit-for-bit reproducible) rather than in a kernel of its own; the caller decides
// (blujax/kernels/attention.py). delta is then also the workspace for those sums:
// [B, H, Tq + AttentionDqRoom(Tq, D)], delta in its first B * H * Tq values and the float32 dQ
// tiles after them; without sum_dq it is [B, H, Tq]. Only the Hopper bfloat16 backward sums
// dQ (attention.cu); the other kernels, and the CPU, run as without it and leave the room.
// counter (one int32) is scratch in the same way: the Hopper forward's CTAs count off their
// units of work in it; callers drop it, and the CPU leaves it.
// The qkv form writes dq, dk, dv into one [B, T, 3, H, D] tensor (dqkv[:, :, 0] = dq, 1 = dk,
// 2 = dv), the gradient of a fused QKV projection's output, so that no pass of the program
// concatenates the three; it needs Tq == Tk and KV == H.
// The GPU runs float32 and bfloat16 with D = 64 or 128; the CPU any D, and float64 too.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/ffi_util.h"

namespace blujax {

struct AttentionDims {
  int64_t batch = 0, q_len = 0, kv_len = 0, heads = 0, head_dim = 0;
  // Key/value heads (KV, dividing heads) and the query heads per key/value head (G = H / KV;
  // 1 for multi-head attention, and where there are no heads at all).
  int64_t kv_heads = 0, group = 1;
};

inline ffi::DataType AttentionStatType(ffi::DataType x) {
  return x == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

// Rank 4, a float dtype this backend runs.
inline ffi::Error CheckAttentionTensor(const char* op, const char* name, const ffi::AnyBuffer& x,
                                       bool allow_f64) {
  auto t = x.element_type();
  bool ok = t == ffi::DataType::F32 || t == ffi::DataType::BF16 ||
            (allow_f64 && t == ffi::DataType::F64);
  if (!ok)
    return InvalidArgument(op, ": ", name, " has unsupported dtype ", DtypeName(t),
                           " (this backend supports ",
                           allow_f64 ? "float32, float64 and bfloat16)" : "float32 and bfloat16)");
  if (x.dimensions().size() != 4)
    return InvalidArgument(op, ": ", name, " must be [B, T, H, D], got shape ", ShapeString(x));
  return ffi::Error::Success();
}

// q, k, v and the attributes; fills dims.
inline ffi::Error CheckAttentionInputs(const char* op, const ffi::AnyBuffer& q,
                                       const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                       bool causal, double scale, bool allow_f64,
                                       AttentionDims* dims) {
  BLUJAX_RETURN_IF_ERROR(CheckAttentionTensor(op, "q", q, allow_f64));
  BLUJAX_RETURN_IF_ERROR(CheckAttentionTensor(op, "k", k, allow_f64));
  if (k.element_type() != q.element_type())
    return InvalidArgument(op, ": k is ", DtypeName(k.element_type()), " but q is ",
                           DtypeName(q.element_type()));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "v", v, "k", k));
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd[0] != kd[0] || qd[3] != kd[3])
    return InvalidArgument(op, ": q ", ShapeString(q), " and k ", ShapeString(k),
                           " must agree in batch and head size ([B, T, H, D])");
  // Grouped-query attention: KV divides H (both 0 is an empty multi-head call).
  if (kd[2] != qd[2] && (kd[2] < 1 || kd[2] > qd[2] || qd[2] % kd[2] != 0))
    return InvalidArgument(op, ": k and v have ", kd[2], " heads, which do not divide q's ",
                           qd[2], " (q ", ShapeString(q), ", k ", ShapeString(k),
                           "; grouped-query attention needs H / KV query heads a key/value "
                           "head)");
  dims->batch = qd[0];
  dims->q_len = qd[1];
  dims->kv_len = kd[1];
  dims->heads = qd[2];
  dims->head_dim = qd[3];
  dims->kv_heads = kd[2];
  dims->group = kd[2] > 0 ? qd[2] / kd[2] : 1;
  if (dims->q_len < 1 || dims->kv_len < 1 || dims->head_dim < 1)
    return InvalidArgument(op, ": sequence lengths and head size must be >= 1 (q ",
                           ShapeString(q), ", k ", ShapeString(k), ")");
  if (causal && dims->q_len != dims->kv_len)
    return InvalidArgument(op, ": causal attention needs as many queries as keys, got Tq = ",
                           dims->q_len, " and Tk = ", dims->kv_len);
  if (!(scale > 0.0) || !std::isfinite(scale))
    return InvalidArgument(op, ": scale must be finite and > 0, got ", scale);
  // The float kernels round scale to float: it must stay finite and > 0 there too.
  if (q.element_type() != ffi::DataType::F64 &&
      !(scale <= std::numeric_limits<float>::max() && static_cast<float>(scale) > 0.0f))
    return InvalidArgument(op, ": scale must be finite and > 0 as a float32 (the precision of ",
                           DtypeName(q.element_type()), " attention), got ", scale);
  return ffi::Error::Success();
}

// The room per (batch, head) that sum_dq adds to the backward's delta for the float32 dQ
// tiles: ceil(Tq / 64) tiles of 64 x D, and 4 values to align the first tile to 16 bytes
// (blujax.kernels.attention.dq_room says the same).
inline int64_t AttentionDqRoom(int64_t q_len, int64_t head_dim) {
  return (q_len + 63) / 64 * 64 * head_dim + 4;
}

// A per-row statistic: [B, H, Tq] of the stat dtype.
inline ffi::Error CheckAttentionLse(const char* op, const char* name, const ffi::AnyBuffer& lse,
                                    ffi::DataType x_type, const AttentionDims& d) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, name, lse, AttentionStatType(x_type)));
  auto ld = lse.dimensions();
  if (ld.size() != 3 || ld[0] != d.batch || ld[1] != d.heads || ld[2] != d.q_len)
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(lse), ", expected [",
                           d.batch, ", ", d.heads, ", ", d.q_len, "] ([B, H, Tq])");
  return ffi::Error::Success();
}

// The backward's delta result, which is also its workspace: [B, H, Tq] of the stat dtype, or
// with sum_dq [B, H, Tq + AttentionDqRoom(Tq, D)].
inline ffi::Error CheckAttentionDelta(const char* op, const ffi::AnyBuffer& delta,
                                      ffi::DataType x_type, const AttentionDims& d,
                                      bool sum_dq) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "delta", delta, AttentionStatType(x_type)));
  const int64_t len = d.q_len + (sum_dq ? AttentionDqRoom(d.q_len, d.head_dim) : 0);
  auto dd = delta.dimensions();
  if (dd.size() != 3 || dd[0] != d.batch || dd[1] != d.heads || dd[2] != len) {
    if (sum_dq)
      return InvalidArgument(
          op, ": delta has shape ", ShapeString(delta), ", expected [", d.batch, ", ", d.heads,
          ", ", len, "] ([B, H, Tq + ceil(Tq / 64) * 64 * D + 4]): sum_dq=true needs room for "
          "the float32 dQ sums after delta");
    return InvalidArgument(op, ": delta has shape ", ShapeString(delta), ", expected [", d.batch,
                           ", ", d.heads, ", ", len,
                           "] ([B, H, Tq]): with sum_dq=false the workspace holds delta only");
  }
  return ffi::Error::Success();
}

// The forward's counter: one int32.
inline ffi::Error CheckAttentionCounter(const char* op, const ffi::AnyBuffer& counter) {
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "counter", counter, ffi::DataType::S32));
  if (counter.element_count() != 1)
    return InvalidArgument(op, ": counter has shape ", ShapeString(counter),
                           ", expected one int32 value");
  return ffi::Error::Success();
}

// The backward's other operands and its delta result, once q, k, v are checked (dims filled).
inline ffi::Error CheckAttentionBwdOperands(const char* op, const ffi::AnyBuffer& q,
                                            const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                                            const ffi::AnyBuffer& dout,
                                            const ffi::AnyBuffer& dlse,
                                            const ffi::AnyBuffer& delta, const AttentionDims& d,
                                            bool sum_dq) {
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "out", out, "q", q));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dout", dout, "q", q));
  BLUJAX_RETURN_IF_ERROR(CheckAttentionLse(op, "lse", lse, q.element_type(), d));
  BLUJAX_RETURN_IF_ERROR(CheckAttentionLse(op, "dlse", dlse, q.element_type(), d));
  return CheckAttentionDelta(op, delta, q.element_type(), d, sum_dq);
}

// dq, dk, dv like q, k, v.
inline ffi::Error CheckAttentionGrads(const char* op, const ffi::AnyBuffer& q,
                                      const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                      const ffi::AnyBuffer& dq, const ffi::AnyBuffer& dk,
                                      const ffi::AnyBuffer& dv) {
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dq", dq, "q", q));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "dk", dk, "k", k));
  return CheckLike(op, "dv", dv, "v", v);
}

// dqkv [B, T, 3, H, D] of q's dtype, with Tq == Tk.
inline ffi::Error CheckAttentionQkvGrad(const char* op, const ffi::AnyBuffer& q,
                                        const ffi::AnyBuffer& dqkv, const AttentionDims& d) {
  if (d.q_len != d.kv_len)
    return InvalidArgument(op, ": the qkv gradient needs as many queries as keys, got Tq = ",
                           d.q_len, " and Tk = ", d.kv_len);
  if (d.kv_heads != d.heads)
    return InvalidArgument(op, ": the qkv gradient needs as many key/value heads as query "
                           "heads, got H = ", d.heads, " and KV = ", d.kv_heads);
  BLUJAX_RETURN_IF_ERROR(CheckDtype(op, "dqkv", dqkv, q.element_type()));
  auto g = dqkv.dimensions();
  if (g.size() != 5 || g[0] != d.batch || g[1] != d.q_len || g[2] != 3 || g[3] != d.heads ||
      g[4] != d.head_dim)
    return InvalidArgument(op, ": dqkv has shape ", ShapeString(dqkv), ", expected [", d.batch,
                           ", ", d.q_len, ", 3, ", d.heads, ", ", d.head_dim,
                           "] ([B, T, 3, H, D])");
  return ffi::Error::Success();
}

// Every operand, result and attribute of blujax_attention_fwd, as both platforms' handlers
// take them. allow_f64: the backend runs float64 (the CPU). Fills d.
inline ffi::Error CheckAttentionFwd(const char* op, bool allow_f64, const ffi::AnyBuffer& q,
                                    const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                    const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                                    const ffi::AnyBuffer& counter, bool causal, double scale,
                                    AttentionDims* d) {
  BLUJAX_RETURN_IF_ERROR(CheckAttentionInputs(op, q, k, v, causal, scale, allow_f64, d));
  BLUJAX_RETURN_IF_ERROR(CheckLike(op, "out", out, "q", q));
  BLUJAX_RETURN_IF_ERROR(CheckAttentionLse(op, "lse", lse, q.element_type(), *d));
  return CheckAttentionCounter(op, counter);
}

// The same for blujax_attention_bwd.
inline ffi::Error CheckAttentionBwd(const char* op, bool allow_f64, const ffi::AnyBuffer& q,
                                    const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                    const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                                    const ffi::AnyBuffer& dout, const ffi::AnyBuffer& dlse,
                                    const ffi::AnyBuffer& dq, const ffi::AnyBuffer& dk,
                                    const ffi::AnyBuffer& dv, const ffi::AnyBuffer& delta,
                                    bool causal, double scale, bool sum_dq, AttentionDims* d) {
  BLUJAX_RETURN_IF_ERROR(CheckAttentionInputs(op, q, k, v, causal, scale, allow_f64, d));
  BLUJAX_RETURN_IF_ERROR(CheckAttentionBwdOperands(op, q, out, lse, dout, dlse, delta, *d,
                                                   sum_dq));
  return CheckAttentionGrads(op, q, k, v, dq, dk, dv);
}

// The same for blujax_attention_qkv_bwd.
inline ffi::Error CheckAttentionQkvBwd(const char* op, bool allow_f64, const ffi::AnyBuffer& q,
                                       const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                       const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                                       const ffi::AnyBuffer& dout, const ffi::AnyBuffer& dlse,
                                       const ffi::AnyBuffer& dqkv, const ffi::AnyBuffer& delta,
                                       bool causal, double scale, bool sum_dq,
                                       AttentionDims* d) {
  BLUJAX_RETURN_IF_ERROR(CheckAttentionInputs(op, q, k, v, causal, scale, allow_f64, d));
  BLUJAX_RETURN_IF_ERROR(CheckAttentionBwdOperands(op, q, out, lse, dout, dlse, delta, *d,
                                                   sum_dq));
  return CheckAttentionQkvGrad(op, q, dqkv, *d);
}

}  // namespace blujax
