// A real JAX lowering (tests/lit/inputs/make_inputs.py: conv_net): grad of a conv
// (scope conv1, NHWC/HWIO) followed by a dense head. Convolutions, forward and the
// backward weight-gradient convolution, compute in bf16 with an f32 result.
//
// RUN: hlo-amp-opt %S/inputs/conv_net.mlir --policy bf16 | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %S/inputs/conv_net.mlir --policy f16 --op convolution=keep \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=NOCONV

// CHECK-LABEL: func.func public @main
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg2 : (tensor<1x4x4x2xf32>) -> tensor<1x4x4x2xbf16>
// CHECK:         %[[K16:.*]] = stablehlo.convert %arg0 : (tensor<3x3x2x3xf32>) -> tensor<3x3x2x3xbf16>
// CHECK:         stablehlo.convolution(%[[X16]], %[[K16]])
// CHECK-SAME:      : (tensor<1x4x4x2xbf16>, tensor<3x3x2x3xbf16>) -> tensor<1x4x4x3xf32>
// CHECK-COUNT-2: stablehlo.dot_general {{.*}}xbf16>, tensor<{{.*}}xbf16>) -> tensor<{{.*}}xf32>
// The weight gradient is a convolution of x (its bf16 convert shared) with the cotangent.
// CHECK:         %[[G16:.*]] = stablehlo.convert %{{.*}} : (tensor<1x4x4x3xf32>) -> tensor<1x4x4x3xbf16>
// CHECK:         stablehlo.convolution(%[[X16]], %[[G16]])
// CHECK-SAME:      -> tensor<3x3x2x3xf32>
// CHECK:         return

// NOCONV-LABEL: func.func public @main
// NOCONV:         stablehlo.convolution(%arg2, %arg0)
// NOCONV-SAME:      : (tensor<1x4x4x2xf32>, tensor<3x3x2x3xf32>) -> tensor<1x4x4x3xf32>
// NOCONV-COUNT-2: stablehlo.dot_general {{.*}}xf16>, tensor<{{.*}}xf16>) -> tensor<{{.*}}xf32>
// NOCONV-NOT:     stablehlo.convert {{.*}} -> tensor<1x4x4x3xf16>
// NOCONV:         stablehlo.convolution(%arg2, %{{[0-9]+}})
// NOCONV-SAME:      : (tensor<1x4x4x2xf32>, tensor<1x4x4x3xf32>) -> tensor<3x3x2x3xf32>
