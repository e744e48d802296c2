// The cost rule: with only_if_faster and --target cpu, ops XLA:CPU would not run faster
// in 16-bit stay as written (convolutions, every f16 dot); without --target nothing changes.
// RUN: hlo-amp-opt %s --split-input-file --target cpu --policy 'bf16,only_if_faster=true' | filecheck %s --check-prefix=CPU
// RUN: hlo-amp-opt %s --split-input-file --policy 'bf16,only_if_faster=true' | filecheck %s --check-prefix=ANY
// RUN: hlo-amp-opt %s --split-input-file --target cpu --policy 'f16,only_if_faster=true' | filecheck %s --check-prefix=F16

// CPU-LABEL: func.func @conv
// CPU-NOT: stablehlo.convert
// CPU: stablehlo.convolution(%arg0, %arg1) {{.*}} : (tensor<1x8x8x4xf32>, tensor<3x3x4x4xf32>) -> tensor<1x6x6x4xf32>
// ANY-LABEL: func.func @conv
// ANY: %[[L:.*]] = stablehlo.convert %arg0 : (tensor<1x8x8x4xf32>) -> tensor<1x8x8x4xbf16>
// ANY: %[[R:.*]] = stablehlo.convert %arg1 : (tensor<3x3x4x4xf32>) -> tensor<3x3x4x4xbf16>
// ANY: stablehlo.convolution(%[[L]], %[[R]])
func.func @conv(%x: tensor<1x8x8x4xf32>, %k: tensor<3x3x4x4xf32>) -> tensor<1x6x6x4xf32> {
  %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x8x8x4xf32>, tensor<3x3x4x4xf32>) -> tensor<1x6x6x4xf32>
  return %0 : tensor<1x6x6x4xf32>
}

// -----

// F16-LABEL: func.func @dot
// F16-NOT: stablehlo.convert
// F16: stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<32x64xf32>, tensor<64x16xf32>) -> tensor<32x16xf32>
func.func @dot(%a: tensor<32x64xf32>, %b: tensor<64x16xf32>) -> tensor<32x16xf32> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<32x64xf32>, tensor<64x16xf32>) -> tensor<32x16xf32>
  return %0 : tensor<32x16xf32>
}
