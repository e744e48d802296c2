// A constant held as a dense_resource blob (what MLIR's printer writes for large
// constants, with the bytes at the file's end): the passes that read constants (the
// fast mode's range and decay checks, the attention folding) cannot read its elements
// and leave it as written; until 2026-11-30 hlo-amp-opt stopped with an internal error
// ("Cannot cast attribute to DenseElementsAttr").
//
// RUN: hlo-amp-opt %s --policy mixed_bfloat16 | filecheck %s
// RUN: hlo-amp-opt %s --policy mixed_float16 | filecheck %s --check-prefix=F16
// RUN: hlo-amp-opt %s --policy fp8 | filecheck %s --check-prefix=FP8

// CHECK-LABEL: func.func public @main
// CHECK: %[[CST:.*]] = stablehlo.constant dense_resource<blob1> : tensor<4x4xf32>
// CHECK: stablehlo.dot_general {{.*}} -> tensor<4x4xbf16>
// CHECK: stablehlo.multiply %arg0, %[[CST]] : tensor<4x4xf32>
// CHECK: blob1: "0x04000000
// F16: stablehlo.multiply %arg0, %{{.*}} : tensor<4x4xf32>
// F16: blob1:
// FP8: stablehlo.multiply %arg0, %{{.*}} : tensor<4x4xf32>
// FP8: blob1:
module @m {
  func.func public @main(%x: tensor<4x4xf32>, %w: tensor<4x4xf32>) -> tensor<4x4xf32> {
    %c = stablehlo.constant dense_resource<blob1> : tensor<4x4xf32>
    %d = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %m = stablehlo.multiply %x, %c : tensor<4x4xf32>
    %a = stablehlo.add %m, %d : tensor<4x4xf32>
    return %a : tensor<4x4xf32>
  }
}
{-#
  dialect_resources: {
    builtin: {
      blob1: "0x040000000000803F0000803F0000803F0000803F0000803F0000803F0000803F0000803F0000803F0000803F0000803F0000803F0000803F0000803F0000803F0000803F"
    }
  }
#-}
