// chlo.ragged_dot (jax.lax.ragged_dot lowered for GPU and TPU, a mixture of experts'
// grouped matmul) computes like a dot_general: bf16 operands, the f32 result kept, the
// group sizes untouched; under an fp8 action it computes in bf16 (no fp8 form yet).
//
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy bf16 | filecheck %s
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy 'bf16,op:ragged_dot=keep' \
// RUN:   | filecheck %s --check-prefix=KEEP
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy 'bf16,op:ragged_dot=float8_e4m3fn' \
// RUN:   | filecheck %s

// CHECK-LABEL: func.func public @main
// CHECK-DAG: %[[X:.*]] = stablehlo.convert %arg0 : (tensor<16x8xf32>) -> tensor<16x8xbf16>
// CHECK-DAG: %[[W:.*]] = stablehlo.convert %arg1 : (tensor<2x8x24xf32>) -> tensor<2x8x24xbf16>
// CHECK: "chlo.ragged_dot"(%[[X]], %[[W]], %arg2)
// CHECK-SAME: (tensor<16x8xbf16>, tensor<2x8x24xbf16>, tensor<2xi32>) -> tensor<16x24xf32>
// KEEP-NOT: stablehlo.convert
// KEEP: "chlo.ragged_dot"(%arg0, %arg1, %arg2)
func.func public @main(%x: tensor<16x8xf32>, %w: tensor<2x8x24xf32>, %g: tensor<2xi32>) -> tensor<16x24xf32> {
  %0 = "chlo.ragged_dot"(%x, %w, %g) <{precision_config = [#chlo<precision DEFAULT>, #chlo<precision DEFAULT>], ragged_dot_dimension_numbers = #chlo.ragged_dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [1], lhs_ragged_dimensions = [0], rhs_group_dimensions = [0]>}> : (tensor<16x8xf32>, tensor<2x8x24xf32>, tensor<2xi32>) -> tensor<16x24xf32>
  return %0 : tensor<16x24xf32>
}
