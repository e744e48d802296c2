// reduce=bfloat16 on XLA:TPU in the accurate mode: the dots the TPU rule keeps f32
// (XLA:TPU runs them as one bf16 pass anyway) still sum in bf16 across devices. The
// weight gradient contracts the batch, which "data" shards, so XLA's
// partitioner sums its partial results in its result type: the f32 dot, which XLA:TPU
// runs as one bf16 pass, returns bf16 (f32 x f32 -> bf16, a convert back after), the
// arithmetic of the converted dot. The forward dot (features unsharded) keeps its f32
// result. Without reduce= both stay f32; on GPU both are converted and the gradient
// returns bf16. The pass's mark on the kept dots does not reach the output.
//
// RUN: hlo-amp-opt %s --policy bf16,reduce=bfloat16 --target tpu \
// RUN:   | filecheck %s --check-prefix=TPU --enable-var-scope
// RUN: hlo-amp-opt %s --policy bf16 --target tpu \
// RUN:   | filecheck %s --check-prefix=DEFAULT --enable-var-scope
// RUN: hlo-amp-opt %s --policy bf16,reduce=bfloat16 --target gpu \
// RUN:   | filecheck %s --check-prefix=GPU --enable-var-scope

// TPU-LABEL: func.func public @weight_gradient
// TPU-SAME:    (%[[X:[^:]*]]: tensor<16x8xf32> {{.*}}, %[[W:[^:]*]]: tensor<8x4xf32>, %[[DY:[^:]*]]: tensor<16x4xf32>
// TPU-NOT:     hlo_amp.
// TPU:         %[[Y:.*]] = stablehlo.dot_general %[[X]], %[[W]], contracting_dims = [1] x [0] : (tensor<16x8xf32>, tensor<8x4xf32>) -> tensor<16x4xf32>
// TPU-NOT:     hlo_amp.
// TPU-NEXT:    %[[G:.*]] = stablehlo.dot_general %[[X]], %[[DY]], contracting_dims = [0] x [0] : (tensor<16x8xf32>, tensor<16x4xf32>) -> tensor<8x4xbf16>
// TPU-NEXT:    %[[G32:.*]] = stablehlo.convert %[[G]] : (tensor<8x4xbf16>) -> tensor<8x4xf32>
// TPU-NEXT:    return %[[Y]], %[[G32]]

// DEFAULT-LABEL: func.func public @weight_gradient
// DEFAULT:       stablehlo.dot_general {{.*}} : (tensor<16x8xf32>, tensor<8x4xf32>) -> tensor<16x4xf32>
// DEFAULT-NEXT:  stablehlo.dot_general {{.*}} : (tensor<16x8xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
// DEFAULT-NEXT:  return

// GPU-LABEL: func.func public @weight_gradient
// GPU:         stablehlo.dot_general {{.*}} : (tensor<16x8xbf16>, tensor<8x4xbf16>) -> tensor<16x4xf32>
// GPU:         stablehlo.dot_general {{.*}} : (tensor<16x8xbf16>, tensor<16x4xbf16>) -> tensor<8x4xbf16>
module @dp_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["data"=8]>
  func.func public @weight_gradient(%x: tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}]>}, %w: tensor<8x4xf32>, %dy: tensor<16x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}]>}) -> (tensor<16x4xf32>, tensor<8x4xf32>) {
    %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<16x8xf32>, tensor<8x4xf32>) -> tensor<16x4xf32>
    %dw = stablehlo.dot_general %x, %dy, contracting_dims = [0] x [0] : (tensor<16x8xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
    return %y, %dw : tensor<16x4xf32>, tensor<8x4xf32>
  }
}
