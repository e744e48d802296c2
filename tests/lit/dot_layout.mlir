// RUN: hlo-amp-opt %s --pass hlo-amp-fast-dot-layout | filecheck %s --enable-var-scope
// Idempotence: relaid dots are fast and safe, so a second run changes nothing.
// RUN: hlo-amp-opt %s --pass hlo-amp-fast-dot-layout \
// RUN:   | hlo-amp-opt --pass hlo-amp-fast-dot-layout | filecheck %s --enable-var-scope

// hlo-amp-fast-dot-layout: bf16 x bf16 -> f32 dot_generals that XLA:CPU would upcast to
// f32 (or crash on) are relaid to the NT form [batch, m, k] x [batch, n, k].

// The weight-gradient dot x^T @ dy (contracting [0] x [0]) is upcast to f32 by
// XLA:CPU as written. Both operands are relaid to [m, k] / [n, k] through a 1-D
// reshape behind an optimization_barrier, so XLA keeps the copy.
// CHECK-LABEL: func.func @weight_grad
// CHECK-SAME: (%[[X:.*]]: tensor<256x512xbf16>, %[[DY:.*]]: tensor<256x384xbf16>)
// CHECK: %[[XT:.*]] = stablehlo.transpose %[[X]], dims = [1, 0] : (tensor<256x512xbf16>) -> tensor<512x256xbf16>
// CHECK: %[[XF:.*]] = stablehlo.reshape %[[XT]] : (tensor<512x256xbf16>) -> tensor<131072xbf16>
// CHECK: %[[XB:.*]] = stablehlo.optimization_barrier %[[XF]] : tensor<131072xbf16>
// CHECK: %[[LHS:.*]] = stablehlo.reshape %[[XB]] : (tensor<131072xbf16>) -> tensor<512x256xbf16>
// CHECK: %[[DYT:.*]] = stablehlo.transpose %[[DY]], dims = [1, 0] : (tensor<256x384xbf16>) -> tensor<384x256xbf16>
// CHECK: %[[DYF:.*]] = stablehlo.reshape %[[DYT]]
// CHECK: %[[DYB:.*]] = stablehlo.optimization_barrier %[[DYF]]
// CHECK: %[[RHS:.*]] = stablehlo.reshape %[[DYB]] : (tensor<98304xbf16>) -> tensor<384x256xbf16>
// CHECK: %[[DOT:.*]] = stablehlo.dot_general %[[LHS]], %[[RHS]], contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<512x256xbf16>, tensor<384x256xbf16>) -> tensor<512x384xf32>
// CHECK: return %[[DOT]] : tensor<512x384xf32>
func.func @weight_grad(%x: tensor<256x512xbf16>, %dy: tensor<256x384xbf16>) -> tensor<512x384xf32> {
  %0 = stablehlo.dot_general %x, %dy, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<256x512xbf16>, tensor<256x384xbf16>) -> tensor<512x384xf32>
  return %0 : tensor<512x384xf32>
}

// A forward dot ([1] x [0]) already runs on YNNPACK: left alone.
// CHECK-LABEL: func.func @forward_untouched
// CHECK-NOT: stablehlo.transpose
// CHECK-NOT: stablehlo.optimization_barrier
// CHECK: stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0]
func.func @forward_untouched(%x: tensor<256x512xbf16>, %w: tensor<512x384xbf16>) -> tensor<256x384xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<256x512xbf16>, tensor<512x384xbf16>) -> tensor<256x384xf32>
  return %0 : tensor<256x384xf32>
}

// An NT dot ([1] x [1]) is fast and survives XLA's operand swap when its result is
// transposed: left alone.
// CHECK-LABEL: func.func @input_grad_untouched
// CHECK-NOT: stablehlo.optimization_barrier
// CHECK: stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [1]
func.func @input_grad_untouched(%dy: tensor<256x384xbf16>, %w: tensor<512x384xbf16>) -> tensor<256x512xf32> {
  %0 = stablehlo.dot_general %dy, %w, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<256x384xbf16>, tensor<512x384xbf16>) -> tensor<256x512xf32>
  %1 = stablehlo.transpose %0, dims = [1, 0] : (tensor<256x512xf32>) -> tensor<512x256xf32>
  return %0 : tensor<256x512xf32>
}

// An NN dot whose result is transposed: XLA folds the transpose by swapping the
// operands after deciding to run it in bf16, and the executable fails at run time.
// Only the rhs is relaid (to the NT form); the lhs and the transpose stay.
// CHECK-LABEL: func.func @forward_transposed_result
// CHECK-SAME: (%[[X:.*]]: tensor<256x512xbf16>, %[[W:.*]]: tensor<512x384xbf16>)
// CHECK: %[[WT:.*]] = stablehlo.transpose %[[W]], dims = [1, 0] : (tensor<512x384xbf16>) -> tensor<384x512xbf16>
// CHECK: %[[WF:.*]] = stablehlo.reshape %[[WT]]
// CHECK: %[[WB:.*]] = stablehlo.optimization_barrier %[[WF]]
// CHECK: %[[RHS:.*]] = stablehlo.reshape %[[WB]] : (tensor<196608xbf16>) -> tensor<384x512xbf16>
// CHECK: %[[DOT:.*]] = stablehlo.dot_general %[[X]], %[[RHS]], contracting_dims = [1] x [1]
// CHECK: %[[T:.*]] = stablehlo.transpose %[[DOT]], dims = [1, 0]
// CHECK: return %[[T]]
func.func @forward_transposed_result(%x: tensor<256x512xbf16>, %w: tensor<512x384xbf16>) -> tensor<384x256xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<256x512xbf16>, tensor<512x384xbf16>) -> tensor<256x384xf32>
  %1 = stablehlo.transpose %0, dims = [1, 0] : (tensor<256x384xf32>) -> tensor<384x256xf32>
  return %1 : tensor<384x256xf32>
}

// The lhs is a convert of a transpose: the import gives it the transpose's column-major
// layout and XLA upcasts the dot. The lhs gets a fresh row-major layout (no transpose
// needed, its order is already right).
// CHECK-LABEL: func.func @transposed_operand
// CHECK: %[[T:.*]] = stablehlo.transpose %arg0, dims = [1, 0]
// CHECK: %[[C:.*]] = stablehlo.convert %[[T]] : (tensor<256x512xf32>) -> tensor<256x512xbf16>
// CHECK-NOT: stablehlo.transpose %[[C]]
// CHECK: %[[CF:.*]] = stablehlo.reshape %[[C]] : (tensor<256x512xbf16>) -> tensor<131072xbf16>
// CHECK: %[[CB:.*]] = stablehlo.optimization_barrier %[[CF]]
// CHECK: %[[LHS:.*]] = stablehlo.reshape %[[CB]] : (tensor<131072xbf16>) -> tensor<256x512xbf16>
// CHECK: %[[RHS:.*]] = stablehlo.reshape %{{.*}} : (tensor<196608xbf16>) -> tensor<384x512xbf16>
// CHECK: stablehlo.dot_general %[[LHS]], %[[RHS]], contracting_dims = [1] x [1]
func.func @transposed_operand(%xt: tensor<512x256xf32>, %w: tensor<512x384xbf16>) -> tensor<256x384xf32> {
  %0 = stablehlo.transpose %xt, dims = [1, 0] : (tensor<512x256xf32>) -> tensor<256x512xf32>
  %1 = stablehlo.convert %0 : (tensor<256x512xf32>) -> tensor<256x512xbf16>
  %2 = stablehlo.dot_general %1, %w, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<256x512xbf16>, tensor<512x384xbf16>) -> tensor<256x384xf32>
  return %2 : tensor<256x384xf32>
}

// Attention's bhqk,bhqd->bhkd (contracting [2] x [2] with batch [0, 1]) falls off the
// fast path like the weight gradient; both operands move their q dimension minor-most.
// CHECK-LABEL: func.func @attention_key_grad
// CHECK-SAME: (%[[P:.*]]: tensor<4x6x65x65xbf16>, %[[Q:.*]]: tensor<4x6x65x64xbf16>)
// CHECK: %[[PT:.*]] = stablehlo.transpose %[[P]], dims = [0, 1, 3, 2]
// CHECK: %[[LHS:.*]] = stablehlo.reshape %{{.*}} : (tensor<101400xbf16>) -> tensor<4x6x65x65xbf16>
// CHECK: %[[QT:.*]] = stablehlo.transpose %[[Q]], dims = [0, 1, 3, 2] : (tensor<4x6x65x64xbf16>) -> tensor<4x6x64x65xbf16>
// CHECK: %[[RHS:.*]] = stablehlo.reshape %{{.*}} : (tensor<99840xbf16>) -> tensor<4x6x64x65xbf16>
// CHECK: %[[DOT:.*]] = stablehlo.dot_general %[[LHS]], %[[RHS]], batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [3]
// CHECK-SAME: -> tensor<4x6x65x64xf32>
// CHECK: return %[[DOT]]
func.func @attention_key_grad(%p: tensor<4x6x65x65xbf16>, %q: tensor<4x6x65x64xbf16>) -> tensor<4x6x65x64xf32> {
  %0 = stablehlo.dot_general %p, %q, batching_dims = [0, 1] x [0, 1], contracting_dims = [2] x [2], precision = [DEFAULT, DEFAULT] : (tensor<4x6x65x65xbf16>, tensor<4x6x65x64xbf16>) -> tensor<4x6x65x64xf32>
  return %0 : tensor<4x6x65x64xf32>
}

// A 3-D dense weight gradient (contracting [0, 1] x [0, 1]) with a transposed result.
// XLA's DotDecomposer would turn it into an NN dot that crashes once the transpose is
// folded; the pass collapses it to a canonical NT dot itself.
// CHECK-LABEL: func.func @dense3d_weight_grad_transposed
// CHECK: stablehlo.transpose %arg0, dims = [2, 0, 1] : (tensor<8x65x384xbf16>) -> tensor<384x8x65xbf16>
// CHECK: %[[LHS:.*]] = stablehlo.reshape %{{.*}} : (tensor<199680xbf16>) -> tensor<384x520xbf16>
// CHECK: stablehlo.transpose %arg1, dims = [2, 0, 1] : (tensor<8x65x96xbf16>) -> tensor<96x8x65xbf16>
// CHECK: %[[RHS:.*]] = stablehlo.reshape %{{.*}} : (tensor<49920xbf16>) -> tensor<96x520xbf16>
// CHECK: %[[DOT:.*]] = stablehlo.dot_general %[[LHS]], %[[RHS]], contracting_dims = [1] x [1]
// CHECK-SAME: -> tensor<384x96xf32>
// CHECK: %[[T:.*]] = stablehlo.transpose %[[DOT]], dims = [1, 0]
// CHECK: return %[[T]]
func.func @dense3d_weight_grad_transposed(%x: tensor<8x65x384xbf16>, %dy: tensor<8x65x96xbf16>) -> tensor<96x384xf32> {
  %0 = stablehlo.dot_general %x, %dy, contracting_dims = [0, 1] x [0, 1], precision = [DEFAULT, DEFAULT] : (tensor<8x65x384xbf16>, tensor<8x65x96xbf16>) -> tensor<384x96xf32>
  %1 = stablehlo.transpose %0, dims = [1, 0] : (tensor<384x96xf32>) -> tensor<96x384xf32>
  return %1 : tensor<96x384xf32>
}

// Two weight gradients of the same input share one relaid copy of it.
// CHECK-LABEL: func.func @shared_operand
// CHECK: %[[XT:.*]] = stablehlo.transpose %arg0
// CHECK: %[[X:.*]] = stablehlo.reshape %{{.*}} : (tensor<131072xbf16>) -> tensor<512x256xbf16>
// CHECK: stablehlo.transpose %arg1
// CHECK: stablehlo.dot_general %[[X]], %{{.*}}, contracting_dims = [1] x [1]
// CHECK-NOT: stablehlo.transpose %arg0
// CHECK: stablehlo.transpose %arg2
// CHECK: stablehlo.dot_general %[[X]], %{{.*}}, contracting_dims = [1] x [1]
func.func @shared_operand(%x: tensor<256x512xbf16>, %a: tensor<256x384xbf16>, %b: tensor<256x384xbf16>) -> (tensor<512x384xf32>, tensor<512x384xf32>) {
  %0 = stablehlo.dot_general %x, %a, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<256x512xbf16>, tensor<256x384xbf16>) -> tensor<512x384xf32>
  %1 = stablehlo.dot_general %x, %b, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<256x512xbf16>, tensor<256x384xbf16>) -> tensor<512x384xf32>
  return %0, %1 : tensor<512x384xf32>, tensor<512x384xf32>
}

// f32 dots are not this pass's business (their path is chosen after layout assignment).
// CHECK-LABEL: func.func @f32_untouched
// CHECK-NOT: stablehlo.transpose
// CHECK: stablehlo.dot_general %arg0, %arg1, contracting_dims = [0] x [0]
func.func @f32_untouched(%x: tensor<256x512xf32>, %dy: tensor<256x384xf32>) -> tensor<512x384xf32> {
  %0 = stablehlo.dot_general %x, %dy, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<256x512xf32>, tensor<256x384xf32>) -> tensor<512x384xf32>
  return %0 : tensor<512x384xf32>
}

// bf16 x bf16 -> bf16 never reaches YNNPACK: left alone.
// CHECK-LABEL: func.func @bf16_result_untouched
// CHECK-NOT: stablehlo.transpose
// CHECK: stablehlo.dot_general %arg0, %arg1, contracting_dims = [0] x [0]
func.func @bf16_result_untouched(%x: tensor<256x512xbf16>, %dy: tensor<256x384xbf16>) -> tensor<512x384xbf16> {
  %0 = stablehlo.dot_general %x, %dy, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<256x512xbf16>, tensor<256x384xbf16>) -> tensor<512x384xbf16>
  return %0 : tensor<512x384xbf16>
}

// m == 1: YNNPACK does not take matrix-vector products in any layout.
// CHECK-LABEL: func.func @matvec_untouched
// CHECK-NOT: stablehlo.transpose
// CHECK: stablehlo.dot_general %arg0, %arg1, contracting_dims = [0] x [0]
func.func @matvec_untouched(%v: tensor<512x1xbf16>, %w: tensor<512x384xbf16>) -> tensor<1x384xf32> {
  %0 = stablehlo.dot_general %v, %w, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<512x1xbf16>, tensor<512x384xbf16>) -> tensor<1x384xf32>
  return %0 : tensor<1x384xf32>
}

// Dots in nested regions are rewritten in place.
// CHECK-LABEL: func.func @inside_while
// CHECK: stablehlo.while
// CHECK: do {
// CHECK: stablehlo.transpose %arg0, dims = [1, 0]
// CHECK: stablehlo.optimization_barrier
// CHECK: stablehlo.dot_general %{{.*}}, %{{.*}}, contracting_dims = [1] x [1]
func.func @inside_while(%x: tensor<256x512xbf16>, %dy: tensor<256x384xbf16>) -> tensor<512x384xf32> {
  %init = stablehlo.constant dense<0.0> : tensor<512x384xf32>
  %i0 = stablehlo.constant dense<0> : tensor<i32>
  %r:2 = stablehlo.while(%it = %i0, %acc = %init) : tensor<i32>, tensor<512x384xf32>
  cond {
    %n = stablehlo.constant dense<2> : tensor<i32>
    %c = stablehlo.compare LT, %it, %n : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %c : tensor<i1>
  } do {
    %g = stablehlo.dot_general %x, %dy, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<256x512xbf16>, tensor<256x384xbf16>) -> tensor<512x384xf32>
    %s = stablehlo.add %acc, %g : tensor<512x384xf32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %it, %one : tensor<i32>
    stablehlo.return %next, %s : tensor<i32>, tensor<512x384xf32>
  }
  return %r#1 : tensor<512x384xf32>
}
