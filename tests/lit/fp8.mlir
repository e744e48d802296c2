// The fp8 pass (hlo-amp-fp8) after insert_converts: per-tensor current scaling in the
// direct form XLA:GPU keeps as one fp8 GEMM in cuBLASLt and in Triton alike: the dot
// reads the fp8 tensors, and its result is multiplied by the product of the two scalar
// scales (hlo_amp/targets/gpu.py).
// The locations pick the direction: transpose(jvp(...)) is the backward pass.
//
// RUN: hlo-amp-opt %s --split-input-file --policy 'fp8,propagate=false,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope
//
// Idempotence: the pipeline on its own (located) output changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --debug-info \
// RUN:   --policy 'fp8,propagate=false,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | hlo-amp-opt --split-input-file --policy 'fp8,propagate=false,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope
//
// insert_converts alone only marks the dots (the operand formats and the dequantise type).
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts \
// RUN:   --policy 'fp8,propagate=false,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=MARK
//
// For XLA:CPU the form is the same; the scales are not rounded to bf16 (XLA:CPU
// widens the fp8 dot to f32, where the scales apply exactly).
// RUN: hlo-amp-opt %s --split-input-file --target cpu \
// RUN:   --policy 'fp8,propagate=false,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=CPU
//
// The checks above are the accurate mode (propagate=false: the dots read f32 values). The
// preset's fast mode first converts a dot's f32 operands to bf16, which propagation
// keeps its producers in; the quantisation reads that bf16 value.
// RUN: hlo-amp-opt %s --split-input-file --policy 'fp8,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=FAST
//
// A scope rule takes a scope back to bf16, as for any dtype.
// RUN: hlo-amp-opt %s --split-input-file \
// RUN:   --policy 'fp8,propagate=false,scope:attn=bfloat16,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=SCOPE
//
// float8_e4m3fn: e4m3fn for both operands, backward dots included.
// RUN: hlo-amp-opt %s --split-input-file --policy 'bf16,op:dot_general=float8_e4m3fn' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=E4M3
//
// The report: fp8 operand types, the reasons, the fallbacks.
// RUN: hlo-amp-opt %s --split-input-file --policy 'fp8,propagate=false,first_matrix_op=none,last_matrix_op=none' \
// RUN:   --report %t.json -o /dev/null
// RUN: filecheck %s --input-file %t.json --check-prefix=JSON

// A forward dot: both operands e4m3fn. amax = max|x|, scale = amax * (1/448) rounded to the
// bf16 the GPU applies it in, 1 when that is 0, NaN when it is not finite (the dot's
// result is then NaN, so the loss scaler skips the step); q = convert(clamp(x /
// scale)); the dot reads q and w's q and keeps its f32 result, times the scale product.
// CHECK-LABEL: func.func @forward
// CHECK-SAME:    (%[[X:.*]]: tensor<32x64xf32>, %[[W:.*]]: tensor<64x16xf32>)
// CHECK:         %[[ABS:.*]] = stablehlo.abs %[[X]] : tensor<32x64xf32>
// CHECK:         %[[ZERO:.*]] = stablehlo.constant dense<0.000000e+00> : tensor<f32>
// CHECK:         %[[AMAX:.*]] = stablehlo.reduce(%[[ABS]] init: %[[ZERO]]) applies stablehlo.maximum across dimensions = [0, 1]
// CHECK:         %[[RFMAX:.*]] = stablehlo.constant dense<0.00223214296> : tensor<f32>
// CHECK:         %[[S0:.*]] = stablehlo.multiply %[[AMAX]], %[[RFMAX]] : tensor<f32>
// CHECK:         %[[S16:.*]] = stablehlo.convert %[[S0]] : (tensor<f32>) -> tensor<bf16>
// CHECK:         %[[S1:.*]] = stablehlo.convert %[[S16]] : (tensor<bf16>) -> tensor<f32>
// CHECK:         %[[POS:.*]] = stablehlo.compare GT, %[[S1]], %{{.*}}, FLOAT
// CHECK:         %[[FIN:.*]] = stablehlo.is_finite %[[S1]]
// CHECK:         %[[OK:.*]] = stablehlo.and %[[POS]], %[[FIN]]
// CHECK:         %[[ONE:.*]] = stablehlo.constant dense<1.000000e+00> : tensor<f32>
// CHECK:         %[[NAN:.*]] = stablehlo.constant dense<0x7FC00000> : tensor<f32>
// CHECK:         %[[ELSE:.*]] = stablehlo.select %[[FIN]], %[[ONE]], %[[NAN]] : tensor<i1>, tensor<f32>
// CHECK:         %[[S:.*]] = stablehlo.select %[[OK]], %[[S1]], %[[ELSE]] : tensor<i1>, tensor<f32>
// CHECK:         %[[SB:.*]] = stablehlo.broadcast_in_dim %[[S]], dims = [] : (tensor<f32>) -> tensor<32x64xf32>
// CHECK:         %[[SCALED:.*]] = stablehlo.divide %[[X]], %[[SB]] : tensor<32x64xf32>
// CHECK:         %[[LO:.*]] = stablehlo.constant dense<-4.480000e+02> : tensor<f32>
// CHECK:         %[[HI:.*]] = stablehlo.constant dense<4.480000e+02> : tensor<f32>
// CHECK:         %[[CL:.*]] = stablehlo.clamp %[[LO]], %[[SCALED]], %[[HI]]
// CHECK:         %[[Q:.*]] = stablehlo.convert %[[CL]] : (tensor<32x64xf32>) -> tensor<32x64xf8E4M3FN>
// CHECK:         stablehlo.abs %[[W]] : tensor<64x16xf32>
// CHECK:         stablehlo.select
// CHECK:         %[[WS:.*]] = stablehlo.select
// CHECK:         %[[WQ:.*]] = stablehlo.convert %{{.*}} : (tensor<64x16xf32>) -> tensor<64x16xf8E4M3FN>
// CHECK:         %[[SS:.*]] = stablehlo.multiply %[[S]], %[[WS]] : tensor<f32>
// CHECK:         %[[D:.*]] = stablehlo.dot_general %[[Q]], %[[WQ]], contracting_dims = [1] x [0] : (tensor<32x64xf8E4M3FN>, tensor<64x16xf8E4M3FN>) -> tensor<32x16xf32>
// CHECK:         %[[SSB:.*]] = stablehlo.broadcast_in_dim %[[SS]], dims = [] : (tensor<f32>) -> tensor<32x16xf32>
// CHECK:         %[[R:.*]] = stablehlo.multiply %[[D]], %[[SSB]] : tensor<32x16xf32>
// CHECK-NOT:     hlo_amp.fp8
// CHECK:         return %[[R]] : tensor<32x16xf32>
// MARK-LABEL:  func.func @forward
// MARK-NOT:      stablehlo.convert
// MARK:          stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] {hlo_amp.fp8 = [f8E4M3FN, f8E4M3FN, bf16]} : (tensor<32x64xf32>, tensor<64x16xf32>) -> tensor<32x16xf32>
// FAST-LABEL:  func.func @forward
// FAST-SAME:     (%[[X:.*]]: tensor<32x64xf32>, %[[W:.*]]: tensor<64x16xf32>)
// FAST:          %[[X16:.*]] = stablehlo.convert %[[X]] : (tensor<32x64xf32>) -> tensor<32x64xbf16>
// FAST:          %[[W16:.*]] = stablehlo.convert %[[W]] : (tensor<64x16xf32>) -> tensor<64x16xbf16>
// FAST:          stablehlo.abs %[[X16]] : tensor<32x64xbf16>
// FAST:          %[[XUP:.*]] = stablehlo.convert %[[X16]] : (tensor<32x64xbf16>) -> tensor<32x64xf32>
// FAST:          stablehlo.divide %[[XUP]], %{{.*}} : tensor<32x64xf32>
// FAST:          %[[Q:.*]] = stablehlo.convert %{{.*}} : (tensor<32x64xf32>) -> tensor<32x64xf8E4M3FN>
// FAST:          %[[WUP:.*]] = stablehlo.convert %[[W16]] : (tensor<64x16xbf16>) -> tensor<64x16xf32>
// FAST:          %[[WQ:.*]] = stablehlo.convert %{{.*}} : (tensor<64x16xf32>) -> tensor<64x16xf8E4M3FN>
// FAST:          stablehlo.dot_general %[[Q]], %[[WQ]], contracting_dims = [1] x [0] : (tensor<32x64xf8E4M3FN>, tensor<64x16xf8E4M3FN>) -> tensor<32x16xf32>
// FAST:          return
// CPU-LABEL:   func.func @forward
// CPU-NOT:       bf16
// CPU:           %[[Q:.*]] = stablehlo.convert %{{.*}} : (tensor<32x64xf32>) -> tensor<32x64xf8E4M3FN>
// CPU:           stablehlo.dot_general %[[Q]], %{{.*}} : (tensor<32x64xf8E4M3FN>, tensor<64x16xf8E4M3FN>) -> tensor<32x16xf32>
func.func @forward(%x: tensor<32x64xf32>, %w: tensor<64x16xf32>) -> tensor<32x16xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<32x64xf32>, tensor<64x16xf32>) -> tensor<32x16xf32> loc("jit(f)/jvp(mlp)/dot_general")
  return %0 : tensor<32x16xf32>
}

// -----

// Backward dots: the operand carrying the incoming gradient (computed in the backward
// pass from the seed cotangent) is e5m2 (fmax 57344), the forward values e4m3fn. The
// gradient is quantised once for both dots; so is every other value.
// CHECK-LABEL: func.func @backward
// CHECK-SAME:    (%[[X:.*]]: tensor<32x64xf32>, %[[W:.*]]: tensor<64x16xf32>, %[[RES:.*]]: tensor<32x16xf32>)
// CHECK:         %[[CT:.*]] = stablehlo.multiply %{{.*}}, %[[RES]] : tensor<32x16xf32>
// CHECK:         %[[XQ:.*]] = stablehlo.convert %{{.*}} : (tensor<32x64xf32>) -> tensor<32x64xf8E4M3FN>
// CHECK:         stablehlo.abs %[[CT]] : tensor<32x16xf32>
// CHECK:         stablehlo.constant dense<1.74386169E-5> : tensor<f32>
// CHECK:         stablehlo.constant dense<-5.734400e+04> : tensor<f32>
// CHECK:         %[[G8:.*]] = stablehlo.convert %{{.*}} : (tensor<32x16xf32>) -> tensor<32x16xf8E5M2>
// CHECK:         stablehlo.dot_general %[[XQ]], %[[G8]], contracting_dims = [0] x [0] : (tensor<32x64xf8E4M3FN>, tensor<32x16xf8E5M2>) -> tensor<64x16xf32>
// CHECK:         %[[WQ:.*]] = stablehlo.convert %{{.*}} : (tensor<64x16xf32>) -> tensor<64x16xf8E4M3FN>
// CHECK-NOT:     -> tensor<32x16xf8E5M2>
// CHECK:         stablehlo.dot_general %[[G8]], %[[WQ]], contracting_dims = [1] x [1] : (tensor<32x16xf8E5M2>, tensor<64x16xf8E4M3FN>) -> tensor<32x64xf32>
// CHECK:         return
// MARK-LABEL:  func.func @backward
// MARK:          stablehlo.dot_general {{.*}} {hlo_amp.fp8 = [f8E4M3FN, f8E5M2, bf16]}
// MARK:          stablehlo.dot_general {{.*}} {hlo_amp.fp8 = [f8E5M2, f8E4M3FN, bf16]}
// E4M3-LABEL:  func.func @backward
// E4M3-NOT:      xf8E5M2>
// E4M3:          return
func.func @backward(%x: tensor<32x64xf32>, %w: tensor<64x16xf32>, %r: tensor<32x16xf32>) -> (tensor<64x16xf32>, tensor<32x64xf32>) {
  %one = stablehlo.constant dense<1.0> : tensor<f32> loc("jit(f)/jvp(mlp)/const")
  %seed = stablehlo.broadcast_in_dim %one, dims = [] : (tensor<f32>) -> tensor<32x16xf32> loc("jit(f)/transpose(jvp(mlp))/broadcast_in_dim")
  %ct = stablehlo.multiply %seed, %r : tensor<32x16xf32> loc("jit(f)/transpose(jvp(mlp))/mul")
  %dw = stablehlo.dot_general %x, %ct, contracting_dims = [0] x [0] : (tensor<32x64xf32>, tensor<32x16xf32>) -> tensor<64x16xf32> loc("jit(f)/transpose(jvp(mlp))/dot_general")
  %dx = stablehlo.dot_general %ct, %w, contracting_dims = [1] x [1] : (tensor<32x16xf32>, tensor<64x16xf32>) -> tensor<32x64xf32> loc("jit(f)/transpose(jvp(mlp))/dot_general")
  return %dw, %dx : tensor<64x16xf32>, tensor<32x64xf32>
}

// -----

// Several contracting dimensions and non-leading batch dimensions are fine: XLA's
// DotDecomposer merges them with a transpose and a reshape, which the fp8 GEMM pattern
// lets through (an einsum "bqhd,bkhd->bhqk" as JAX lowers it).
// CHECK-LABEL: func.func @attention_scores
// CHECK:         stablehlo.dot_general %{{.*}}, %{{.*}}, batching_dims = [0, 2] x [0, 2], contracting_dims = [3] x [3] : (tensor<2x17x4x16xf8E4M3FN>, tensor<2x17x4x16xf8E4M3FN>) -> tensor<2x4x17x17xf32>
// CHECK-LABEL: func.func @two_contracting
// CHECK:         stablehlo.convert %{{.*}} : (tensor<32x4x8xf32>) -> tensor<32x4x8xf8E4M3FN>
// CHECK:         stablehlo.dot_general %{{.*}}, %{{.*}}, contracting_dims = [1, 2] x [0, 1] : (tensor<32x4x8xf8E4M3FN>, tensor<4x8x16xf8E4M3FN>) -> tensor<32x16xf32>
func.func @attention_scores(%q: tensor<2x17x4x16xf32>, %k: tensor<2x17x4x16xf32>) -> tensor<2x4x17x17xf32> {
  %0 = stablehlo.dot_general %q, %k, batching_dims = [0, 2] x [0, 2], contracting_dims = [3] x [3] : (tensor<2x17x4x16xf32>, tensor<2x17x4x16xf32>) -> tensor<2x4x17x17xf32> loc("jit(f)/jvp(attn)/bqhd,bkhd->bhqk/dot_general")
  return %0 : tensor<2x4x17x17xf32>
}
func.func @two_contracting(%x: tensor<32x4x8xf32>, %w: tensor<4x8x16xf32>) -> tensor<32x16xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1, 2] x [0, 1] : (tensor<32x4x8xf32>, tensor<4x8x16xf32>) -> tensor<32x16xf32> loc("jit(f)/jvp(mlp)/dot_general")
  return %0 : tensor<32x16xf32>
}

// -----

// Fallbacks: a dot that cannot be an fp8 GEMM computes in bf16 (f32 result) and the
// report says why: a dimension under 16, a matrix-vector product. f64 dots and
// integer dots are left as written, as under bf16.
// CHECK-LABEL: func.func @small_n
// CHECK-NOT:     f8E
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x64xbf16>, tensor<64x4xbf16>) -> tensor<32x4xf32>
// CHECK-LABEL: func.func @matvec
// CHECK-NOT:     f8E
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x64xbf16>, tensor<64xbf16>) -> tensor<32xf32>
// CHECK-LABEL: func.func @f64
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x64xf64>, tensor<64x16xf64>) -> tensor<32x16xf64>
// CHECK-LABEL: func.func @integer
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x64xi8>, tensor<64x16xi8>) -> tensor<32x16xi32>
// CHECK-LABEL: func.func @conv
// CHECK-NOT:     f8E
// CHECK:         stablehlo.convolution
// CHECK-SAME:      : (tensor<1x8x8x16xbf16>, tensor<3x3x16x16xbf16>) -> tensor<1x6x6x16xf32>
func.func @small_n(%x: tensor<32x64xf32>, %w: tensor<64x4xf32>) -> tensor<32x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<32x64xf32>, tensor<64x4xf32>) -> tensor<32x4xf32> loc("jit(f)/jvp(head)/dot_general")
  return %0 : tensor<32x4xf32>
}
func.func @matvec(%x: tensor<32x64xf32>, %v: tensor<64xf32>) -> tensor<32xf32> {
  %0 = stablehlo.dot_general %x, %v, contracting_dims = [1] x [0] : (tensor<32x64xf32>, tensor<64xf32>) -> tensor<32xf32> loc("jit(f)/jvp(head)/dot_general")
  return %0 : tensor<32xf32>
}
func.func @f64(%x: tensor<32x64xf64>, %w: tensor<64x16xf64>) -> tensor<32x16xf64> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<32x64xf64>, tensor<64x16xf64>) -> tensor<32x16xf64> loc("jit(f)/jvp(mlp)/dot_general")
  return %0 : tensor<32x16xf64>
}
func.func @integer(%x: tensor<32x64xi8>, %w: tensor<64x16xi8>) -> tensor<32x16xi32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<32x64xi8>, tensor<64x16xi8>) -> tensor<32x16xi32> loc("jit(f)/jvp(mlp)/dot_general")
  return %0 : tensor<32x16xi32>
}
func.func @conv(%x: tensor<1x8x8x16xf32>, %k: tensor<3x3x16x16xf32>) -> tensor<1x6x6x16xf32> {
  %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x8x8x16xf32>, tensor<3x3x16x16xf32>) -> tensor<1x6x6x16xf32> loc("jit(f)/stem/conv_general_dilated")
  return %0 : tensor<1x6x6x16xf32>
}

// -----

// scope:attn=bfloat16 forces attn's dots (forward and backward) to bf16 operands and
// result; mlp stays fp8.
// SCOPE-LABEL: func.func @scoped
// SCOPE:         stablehlo.dot_general {{.*}} : (tensor<32x64xbf16>, tensor<64x64xbf16>) -> tensor<32x64xbf16>
// SCOPE:         stablehlo.convert {{.*}} -> tensor<64x64xf8E4M3FN>
// SCOPE:         stablehlo.dot_general {{.*}} : (tensor<32x64xf8E4M3FN>, tensor<64x64xf8E4M3FN>) -> tensor<32x64xf32>
// SCOPE:         stablehlo.dot_general {{.*}} : (tensor<32x64xbf16>, tensor<32x64xbf16>) -> tensor<64x64xbf16>
// SCOPE:         return
// CHECK-LABEL: func.func @scoped
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x64xf8E4M3FN>, tensor<64x64xf8E4M3FN>) -> tensor<32x64xf32>
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x64xf8E4M3FN>, tensor<64x64xf8E4M3FN>) -> tensor<32x64xf32>
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x64xf8E4M3FN>, tensor<32x64xf8E5M2>) -> tensor<64x64xf32>
// CHECK:         return
func.func @scoped(%x: tensor<32x64xf32>, %wa: tensor<64x64xf32>, %wm: tensor<64x64xf32>, %g: tensor<32x64xf32>) -> (tensor<32x64xf32>, tensor<64x64xf32>) {
  %0 = stablehlo.dot_general %x, %wa, contracting_dims = [1] x [0] : (tensor<32x64xf32>, tensor<64x64xf32>) -> tensor<32x64xf32> loc("jit(f)/jvp(attn)/dot_general")
  %1 = stablehlo.dot_general %0, %wm, contracting_dims = [1] x [0] : (tensor<32x64xf32>, tensor<64x64xf32>) -> tensor<32x64xf32> loc("jit(f)/jvp(mlp)/dot_general")
  %2 = stablehlo.dot_general %x, %g, contracting_dims = [0] x [0] : (tensor<32x64xf32>, tensor<32x64xf32>) -> tensor<64x64xf32> loc("jit(f)/transpose(jvp(attn))/dot_general")
  return %1, %2 : tensor<32x64xf32>, tensor<64x64xf32>
}

// JSON:      "policy": "fp8,compute=bfloat16,propagate=false,first_matrix_op=none,last_matrix_op=none",
// JSON:      "direction": "forward",
// JSON:      "operands_after": [
// JSON-NEXT:   "f8E4M3FN",
// JSON-NEXT:   "f8E4M3FN"
// JSON:      "action": "float8_e5m2",
// JSON-NEXT: "rule": "op:dot_general",
// JSON-NEXT: "changed": true,
// JSON-NEXT: "reason": "fp8 e4m3fn x e4m3fn, per-tensor bf16 scales, f32 result",
// JSON:      "direction": "backward",
// JSON:      "operands_after": [
// JSON-NEXT:   "f8E4M3FN",
// JSON-NEXT:   "f8E5M2"
// JSON:      "reason": "fp8 e4m3fn x e5m2 (rhs is the incoming gradient), per-tensor bf16 scales, f32 result",
// JSON:      "reason": "fp8 e5m2 x e4m3fn (lhs is the incoming gradient), per-tensor bf16 scales, f32 result",
// JSON:      "reason": "fp8 e4m3fn x e4m3fn, per-tensor bf16 scales, f32 result",
// JSON:      "reason": "fp8 e4m3fn x e4m3fn, per-tensor bf16 scales, f32 result",
// JSON:      "operands_after": [
// JSON-NEXT:   "bf16",
// JSON-NEXT:   "bf16"
// JSON:      "reason": "fp8 fallback: n=4 under 16 (cuBLASLt pads fp8 GEMMs to multiples of 16); bf16 operands, f32 accumulation",
// JSON:      "reason": "fp8 fallback: a matrix-vector product (the fp8 GEMM needs a free dimension on each operand); bf16 operands, f32 accumulation",
// JSON:      "reason": "fp8 fallback: f64 dot (the fp8 GEMM dequantises to f32, bf16 or f16); f64 op (not asked: f64=true)",
// JSON:      "reason": "not a float op",
// JSON:      "op_kind": "convolution",
// JSON:      "action": "compute",
// JSON-NEXT: "rule": "op:convolution",
// JSON:      "notes": [
// JSON:      "fp8: 1 dot_general as fp8 GEMMs (e4m3fn x e4m3fn 1)
// JSON:      "fp8: 2 dot_general as fp8 GEMMs (e4m3fn x e5m2 1, e5m2 x e4m3fn 1)
// JSON:      "fp8: 2 dot_general as fp8 GEMMs (e4m3fn x e4m3fn 2)
// JSON:      "fp8: 3 dot_general as fp8 GEMMs (e4m3fn x e4m3fn 2, e4m3fn x e5m2 1), {{.*}}; 3 fp8 fallback(s) to the compute dtype (reasons per op)"

// -----

// An f16 dot (a program written in f16): the unscaled fp8 sums (one e4m3 product reaches
// 448 * 448) pass f16's 65504 and a small scale product is 0 in f16, so the dot
// computes and scales in f32 and converts its result to f16 (every element was inf or
// NaN before), and its scales are not rounded to f16 (D is f32).
// CHECK-LABEL: func.func @f16_result
// CHECK:         %[[A:.*]] = stablehlo.reduce({{.*}}) applies stablehlo.maximum {{.*}} -> tensor<f16>
// CHECK:         %[[A32:.*]] = stablehlo.convert %[[A]] : (tensor<f16>) -> tensor<f32>
// CHECK-NEXT:    %{{.*}} = stablehlo.constant dense<0.00223214296> : tensor<f32>
// CHECK-NEXT:    %[[S:.*]] = stablehlo.multiply %[[A32]], %{{.*}} : tensor<f32>
// CHECK-NEXT:    %{{.*}} = stablehlo.constant dense<0.000000e+00> : tensor<f32>
// CHECK-NEXT:    stablehlo.compare GT, %[[S]]
// CHECK:         %[[D:.*]] = stablehlo.dot_general %{{.*}}, %{{.*}}, contracting_dims = [1] x [0] : (tensor<32x64xf8E4M3FN>, tensor<64x16xf8E4M3FN>) -> tensor<32x16xf32>
// CHECK-NEXT:    %[[SSB:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] : (tensor<f32>) -> tensor<32x16xf32>
// CHECK-NEXT:    %[[R:.*]] = stablehlo.multiply %[[D]], %[[SSB]] : tensor<32x16xf32>
// CHECK-NEXT:    %[[R16:.*]] = stablehlo.convert %[[R]] : (tensor<32x16xf32>) -> tensor<32x16xf16>
// CHECK-NEXT:    return %[[R16]] : tensor<32x16xf16>
func.func @f16_result(%x: tensor<32x64xf16>, %w: tensor<64x16xf16>) -> tensor<32x16xf16> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<32x64xf16>, tensor<64x16xf16>) -> tensor<32x16xf16> loc("jit(f)/jvp(mlp)/dot_general")
  return %0 : tensor<32x16xf16>
}

// -----

// A complex constant beside an fp8 dot: jaxlib's bindings cannot read a complex dense
// attribute (TypeError on every read), so the passes that read constants skip it.
// CHECK-LABEL: func.func @complex_constant
// CHECK:         stablehlo.constant dense<(0.000000e+00,1.000000e+00)> : tensor<complex<f32>>
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x64xf8E4M3FN>, tensor<64x16xf8E4M3FN>) -> tensor<32x16xf32>
func.func @complex_constant(%x: tensor<32x64xf32>, %w: tensor<64x16xf32>, %z: tensor<4xcomplex<f32>>) -> (tensor<32x16xf32>, tensor<4xcomplex<f32>>) {
  %i = stablehlo.constant dense<(0.0, 1.0)> : tensor<complex<f32>> loc("jit(f)/jvp(mlp)/const")
  %ib = stablehlo.broadcast_in_dim %i, dims = [] : (tensor<complex<f32>>) -> tensor<4xcomplex<f32>> loc("jit(f)/jvp(mlp)/broadcast_in_dim")
  %zi = stablehlo.multiply %z, %ib : tensor<4xcomplex<f32>> loc("jit(f)/jvp(mlp)/mul")
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<32x64xf32>, tensor<64x16xf32>) -> tensor<32x16xf32> loc("jit(f)/jvp(mlp)/dot_general")
  return %0, %zi : tensor<32x16xf32>, tensor<4xcomplex<f32>>
}
