// Target facts for convolutions. On GPU cuDNN runs only same-type 16-bit convolutions
// (XLA:GPU upcasts convolution(bf16, bf16) -> f32 to f32×f32), so there a convolution
// returns the 16-bit type and a convert follows it, forward and backward; dots keep the
// accurate form (bf16 operands, f32 result: cuBLASLt runs that). On CPU, on TPU (XLA:TPU
// keeps bf16×bf16→f32 convolutions and dots) and with no target, convolutions keep that
// form too (16-bit operands, f32 result).
//
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts --policy bf16 \
// RUN:   --target gpu | filecheck %s --enable-var-scope --check-prefix=GPU
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts --policy f16 \
// RUN:   --target gpu | filecheck %s --enable-var-scope --check-prefix=GPU16
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts --policy bf16 \
// RUN:   --target cpu | filecheck %s --enable-var-scope --check-prefix=CPU
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts --policy bf16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=CPU
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts --policy bf16 \
// RUN:   --target tpu | filecheck %s --enable-var-scope --check-prefix=CPU
// Idempotence for the GPU target. The pass run on its own (located) output changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --debug-info --pass hlo-amp-insert-converts \
// RUN:   --policy bf16 --target gpu | hlo-amp-opt --split-input-file \
// RUN:   --pass hlo-amp-insert-converts --policy bf16 --target gpu \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=GPU
// The fast mode for the GPU target. A convolution inside a 16-bit region is painted like a dot; one
// whose result only f32 ops read still returns bf16, and the convert goes in front of them.
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target gpu \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=MIXED

// GPU-LABEL:   func.func @conv_forward
// GPU:           %[[X16:.*]] = stablehlo.convert %{{.*}} : (tensor<1x5x5x2xf32>) -> tensor<1x5x5x2xbf16>
// GPU:           %[[K16:.*]] = stablehlo.convert %{{.*}} : (tensor<3x3x2x4xf32>) -> tensor<3x3x2x4xbf16>
// GPU:           %[[R16:.*]] = stablehlo.convolution(%[[X16]], %[[K16]])
// GPU-SAME:        : (tensor<1x5x5x2xbf16>, tensor<3x3x2x4xbf16>) -> tensor<1x3x3x4xbf16>
// GPU:           %[[R:.*]] = stablehlo.convert %[[R16]] : (tensor<1x3x3x4xbf16>) -> tensor<1x3x3x4xf32>
// GPU:           return %[[R]] : tensor<1x3x3x4xf32>
// GPU16-LABEL: func.func @conv_forward
// GPU16:         stablehlo.convolution
// GPU16-SAME:      : (tensor<1x5x5x2xf16>, tensor<3x3x2x4xf16>) -> tensor<1x3x3x4xf16>
// GPU16:         stablehlo.convert %{{.*}} : (tensor<1x3x3x4xf16>) -> tensor<1x3x3x4xf32>
// CPU-LABEL:   func.func @conv_forward
// CPU:           %[[R:.*]] = stablehlo.convolution
// CPU-SAME:        : (tensor<1x5x5x2xbf16>, tensor<3x3x2x4xbf16>) -> tensor<1x3x3x4xf32>
// CPU-NEXT:      return %[[R]]
// MIXED-LABEL: func.func @conv_forward
// MIXED:         %[[R16:.*]] = stablehlo.convolution
// MIXED-SAME:      : (tensor<1x5x5x2xbf16>, tensor<3x3x2x4xbf16>) -> tensor<1x3x3x4xbf16>
// MIXED:         %[[R:.*]] = stablehlo.convert %[[R16]] : (tensor<1x3x3x4xbf16>) -> tensor<1x3x3x4xf32>
// MIXED:         return %[[R]] : tensor<1x3x3x4xf32>
func.func @conv_forward(%x: tensor<1x5x5x2xf32>, %k: tensor<3x3x2x4xf32>) -> tensor<1x3x3x4xf32> {
  %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x5x5x2xf32>, tensor<3x3x2x4xf32>) -> tensor<1x3x3x4xf32> loc("jit(f)/conv/conv_general_dilated")
  return %0 : tensor<1x3x3x4xf32>
}

// -----

// The filter gradient JAX's transpose rule writes (batch and feature dims swapped).
// GPU-LABEL:   func.func @conv_filter_gradient
// GPU:           stablehlo.convolution
// GPU-SAME:        : (tensor<1x5x5x2xbf16>, tensor<1x3x3x4xbf16>) -> tensor<3x3x2x4xbf16>
// GPU:           stablehlo.convert %{{.*}} : (tensor<3x3x2x4xbf16>) -> tensor<3x3x2x4xf32>
// CPU-LABEL:   func.func @conv_filter_gradient
// CPU:           stablehlo.convolution
// CPU-SAME:        : (tensor<1x5x5x2xbf16>, tensor<1x3x3x4xbf16>) -> tensor<3x3x2x4xf32>
func.func @conv_filter_gradient(%x: tensor<1x5x5x2xf32>, %g: tensor<1x3x3x4xf32>) -> tensor<3x3x2x4xf32> {
  %0 = stablehlo.convolution(%x, %g) dim_numbers = [f, 0, 1, b]x[i, 0, 1, o]->[0, 1, b, f], window = {stride = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x5x5x2xf32>, tensor<1x3x3x4xf32>) -> tensor<3x3x2x4xf32> loc("jit(f)/transpose(jvp(conv))/conv_general_dilated")
  return %0 : tensor<3x3x2x4xf32>
}

// -----

// A dot keeps the accurate form on every target.
// GPU-LABEL:   func.func @dot_then_conv
// GPU:           stablehlo.dot_general {{.*}} : (tensor<25x2xbf16>, tensor<2x2xbf16>) -> tensor<25x2xf32>
// GPU:           stablehlo.convolution{{.*}} -> tensor<1x3x3x4xbf16>
// Fast mode: the dot's result feeds only the convolution, so it returns bf16 and the
// convolution reads it directly; the relu after the convolution is painted between them
// and the sum (f32-only) reads a converted value.
// MIXED-LABEL: func.func @dot_then_conv
// MIXED:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<25x2xbf16>
// MIXED:         %[[X:.*]] = stablehlo.reshape %[[D]] : (tensor<25x2xbf16>) -> tensor<1x5x5x2xbf16>
// MIXED:         stablehlo.convolution(%[[X]], %{{.*}}){{.*}} -> tensor<1x3x3x4xbf16>
func.func @dot_then_conv(%a: tensor<25x2xf32>, %w: tensor<2x2xf32>, %k: tensor<3x3x2x4xf32>) -> tensor<f32> {
  %0 = stablehlo.dot_general %a, %w, contracting_dims = [1] x [0] : (tensor<25x2xf32>, tensor<2x2xf32>) -> tensor<25x2xf32> loc("jit(f)/dense/dot_general")
  %1 = stablehlo.reshape %0 : (tensor<25x2xf32>) -> tensor<1x5x5x2xf32> loc("jit(f)/reshape")
  %2 = stablehlo.convolution(%1, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x5x5x2xf32>, tensor<3x3x2x4xf32>) -> tensor<1x3x3x4xf32> loc("jit(f)/conv/conv_general_dilated")
  %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %3 = stablehlo.reduce(%2 init: %cst) applies stablehlo.add across dimensions = [0, 1, 2, 3] : (tensor<1x3x3x4xf32>, tensor<f32>) -> tensor<f32> loc("jit(f)/sum")
  return %3 : tensor<f32>
}
