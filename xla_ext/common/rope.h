// The rotary position embedding (RoPE) handler contract, shared by xla_ext/cpu/rope.cc and
// xla_ext/cuda/rope.cu.
//
// blujax_rope_fwd      (x, cos, sin)           -> y
// blujax_rope_bwd      (dy, cos, sin)          -> dx
// blujax_rope_qkv_fwd  (qkv, cos, sin)         -> q, k, v
// blujax_rope_qkv_bwd  (dq, dk, dv, cos, sin)  -> dqkv
//
// Hugging Face Llama's "rotate_half" form: x is [..., T, N, D] (positions, heads, head size;
// D even, H = D / 2) and cos, sin are [T, H] (leading size-1 axes allowed, which is what vmap's
// "expand_dims" produces). For d < H:
//   y[d]     = x[d] cos[t, d] - x[d + H] sin[t, d]
//   y[d + H] = x[d + H] cos[t, d] + x[d] sin[t, d]
// computed in float32 (float64 for float64 x) and rounded to x's dtype once. The backward is
// the inverse rotation, the same with -sin (the transpose of a rotation is its inverse); cos
// and sin get no gradient. cos and sin are float32; with float64 x (CPU only) they may also be
// float64 (both the same dtype).
//
// rope_qkv splits a fused QKV projection's output qkv [..., T, H + 2 KV, D] (H query heads,
// then KV key heads, then KV value heads) into q [..., T, H, D] and k [..., T, KV, D], both
// turned, and v [..., T, KV, D], copied; its backward writes dqkv from dq and dk turned back
// and dv. The head counts come from the shapes of q, k, v (dq, dk, dv).
#pragma once

#include <cstdint>

#include "common/ffi_util.h"

namespace blujax {

struct RopeDims {
  int64_t positions = 0;  // rows of cos a pass covers: the product of the axes before N, D
  int64_t seq = 0;        // T: position p uses row p % T of cos and sin
  int64_t heads = 0;      // N
  int64_t half = 0;       // H = D / 2
};

// x: [..., T, N, D] with D even, in a dtype this backend runs.
inline ffi::Error CheckRopeInput(const char* op, const char* name, const ffi::AnyBuffer& x,
                                 bool allow_f64, RopeDims* d) {
  RowsCols rc;
  BLUJAX_RETURN_IF_ERROR(CheckFloatRows(op, x, allow_f64, &rc));
  auto dims = x.dimensions();
  if (dims.size() < 3)
    return InvalidArgument(op, ": ", name, " must be [..., T, N, D] (positions, heads, head "
                           "size), got shape ", ShapeString(x));
  if (rc.cols % 2 != 0)
    return InvalidArgument(op, ": the head size D must be even, got shape ", ShapeString(x));
  d->seq = dims[dims.size() - 3];
  d->heads = dims[dims.size() - 2];
  d->half = rc.cols / 2;
  d->positions = d->heads == 0 ? 0 : rc.rows / d->heads;
  return ffi::Error::Success();
}

// cos or sin: float32 (or float64 where allowed, the same for both) holding [T, H].
inline ffi::Error CheckRopeTable(const char* op, const char* name, const ffi::AnyBuffer& table,
                                 const ffi::AnyBuffer& x, const RopeDims& d, bool allow_f64) {
  auto t = table.element_type();
  if (!(t == ffi::DataType::F32 || (allow_f64 && t == ffi::DataType::F64)))
    return InvalidArgument(op, ": ", name, " must be float32",
                           allow_f64 ? " (or float64 with float64 x)" : "", ", got ",
                           DtypeName(t));
  auto dims = table.dimensions();
  const size_t r = dims.size();
  bool ok = r >= 2 && dims[r - 2] == d.seq && dims[r - 1] == d.half;
  for (size_t i = 0; ok && i + 2 < r; ++i) ok = dims[i] == 1;
  if (!ok)
    return InvalidArgument(op, ": ", name, " has shape ", ShapeString(table), " but x has shape ",
                           ShapeString(x), "; ", name, " must be [T, D/2] = [", d.seq, ", ",
                           d.half, "] (one row per position, shared by every head)");
  return ffi::Error::Success();
}

// Every operand and result of blujax_rope_fwd (x, cos, sin -> y) or, inverse,
// blujax_rope_bwd (dy, cos, sin -> dx), as both platforms' handlers take them. allow_f64: the
// backend runs float64 (the CPU). Fills d.
inline ffi::Error CheckRope(const char* op, bool allow_f64, bool inverse, const ffi::AnyBuffer& x,
                            const ffi::AnyBuffer& cos, const ffi::AnyBuffer& sin,
                            const ffi::AnyBuffer& y, RopeDims* d) {
  const char* in_name = inverse ? "dy" : "x";
  const char* out_name = inverse ? "dx" : "y";
  BLUJAX_RETURN_IF_ERROR(CheckRopeInput(op, in_name, x, allow_f64, d));
  const bool f64 = allow_f64 && x.element_type() == ffi::DataType::F64;
  BLUJAX_RETURN_IF_ERROR(CheckRopeTable(op, "cos", cos, x, *d, f64));
  BLUJAX_RETURN_IF_ERROR(CheckRopeTable(op, "sin", sin, x, *d, f64));
  if (sin.element_type() != cos.element_type())
    return InvalidArgument(op, ": sin is ", DtypeName(sin.element_type()), " but cos is ",
                           DtypeName(cos.element_type()), "; use one dtype");
  return CheckLike(op, out_name, y, in_name, x);
}

// One part of a call's heads: `heads` heads starting at head `src_head` of the source's rows of
// `src_row` heads, written from head `dst_head` of the destination's rows of `dst_row` heads,
// turned or copied. rope is one part (the whole row, turned); rope_qkv three (q, k, v).
struct RopePart {
  int64_t heads = 0;
  int64_t src_row = 0, src_head = 0;
  int64_t dst_row = 0, dst_head = 0;
  bool rotate = true;
};

constexpr int kMaxRopeParts = 3;

struct RopeLayout {
  RopeDims dims;  // of the whole row (x, or the fused qkv)
  RopePart part[kMaxRopeParts];
  int count = 0;
};

// rope: every head of x turned into the same place of y.
inline RopeLayout WholeRope(const RopeDims& d) {
  RopeLayout l;
  l.dims = d;
  l.part[0] = RopePart{d.heads, d.heads, 0, d.heads, 0, true};
  l.count = 1;
  return l;
}

// Every operand and result of rope_qkv, as both platforms' handlers take them: `whole` is qkv
// [..., T, H + 2 KV, D] (the forward's input, the backward's result dqkv); q, k, v (dq, dk, dv)
// are [..., T, H, D], [..., T, KV, D], [..., T, KV, D] with the same leading axes and dtype.
// split: blujax_rope_qkv_fwd (whole -> parts), else blujax_rope_qkv_bwd. Fills layout.
inline ffi::Error CheckRopeQkv(const char* op, bool allow_f64, bool split,
                               const ffi::AnyBuffer& whole, const ffi::AnyBuffer& q,
                               const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                               const ffi::AnyBuffer& cos, const ffi::AnyBuffer& sin,
                               RopeLayout* layout) {
  const char* whole_name = split ? "qkv" : "dqkv";
  RopeDims& d = layout->dims;
  BLUJAX_RETURN_IF_ERROR(CheckRopeInput(op, whole_name, whole, allow_f64, &d));
  const bool f64 = allow_f64 && whole.element_type() == ffi::DataType::F64;
  BLUJAX_RETURN_IF_ERROR(CheckRopeTable(op, "cos", cos, whole, d, f64));
  BLUJAX_RETURN_IF_ERROR(CheckRopeTable(op, "sin", sin, whole, d, f64));
  if (sin.element_type() != cos.element_type())
    return InvalidArgument(op, ": sin is ", DtypeName(sin.element_type()), " but cos is ",
                           DtypeName(cos.element_type()), "; use one dtype");
  const char* names[3] = {split ? "q" : "dq", split ? "k" : "dk", split ? "v" : "dv"};
  const ffi::AnyBuffer* parts[3] = {&q, &k, &v};
  auto wd = whole.dimensions();
  const size_t rank = wd.size(), head_axis = rank - 2;
  int64_t heads[3];
  for (int s = 0; s < 3; ++s) {
    const ffi::AnyBuffer& b = *parts[s];
    if (b.element_type() != whole.element_type())
      return InvalidArgument(op, ": ", names[s], " is ", DtypeName(b.element_type()), " but ",
                             whole_name, " is ", DtypeName(whole.element_type()));
    auto bd = b.dimensions();
    bool ok = bd.size() == rank;
    for (size_t i = 0; ok && i < rank; ++i) ok = i == head_axis || bd[i] == wd[i];
    if (!ok)
      return InvalidArgument(op, ": ", names[s], " has shape ", ShapeString(b), " but ",
                             whole_name, " has shape ", ShapeString(whole), "; they must agree "
                             "on every axis but the heads (second to last)");
    heads[s] = bd[head_axis];
  }
  if (heads[1] != heads[2] || heads[0] + heads[1] + heads[2] != d.heads)
    return InvalidArgument(op, ": ", whole_name, " has ", d.heads, " heads but ", names[0], ", ",
                           names[1], ", ", names[2], " have ", heads[0], ", ", heads[1], ", ",
                           heads[2], "; they must be H, KV, KV with H + 2 KV = ", d.heads);
  const int64_t n = d.heads, h = heads[0], kv = heads[1];
  const int64_t first[3] = {0, h, h + kv};
  for (int s = 0; s < 3; ++s) {
    layout->part[s] = split ? RopePart{heads[s], n, first[s], heads[s], 0, s < 2}
                            : RopePart{heads[s], heads[s], 0, n, first[s], s < 2};
  }
  layout->count = 3;
  return ffi::Error::Success();
}

}  // namespace blujax
