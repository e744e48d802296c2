// The embedding gradient's sum follows reduce= (hlo-amp-comm-precision): an add scatter
// whose 16-bit updates are sharded over a mesh axis the table does not use (each device
// scatters its share of the batch, XLA all-reduces the tables right after the scatter,
// in its type) sums in 16 bit where the reduce precision is 16-bit: the fast mode's
// default, reduce=bfloat16. Its operand is converted down, it reads the 16-bit updates,
// and a convert back keeps the f32 result type. reduce=float32 keeps it f32; so do the
// accurate modes, whose updates are f32.
//
// The whole pipeline from an f32 program:
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target gpu \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=MIXED
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16,reduce=float32 --target gpu \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=F32
// RUN: hlo-amp-opt %s --split-input-file --policy bf16,reduce=bfloat16 --target gpu \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=F32
// Idempotence:
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target gpu \
// RUN:   | hlo-amp-opt --split-input-file --policy mixed_bfloat16 --target gpu \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=MIXED
// The pass alone, on updates that are already 16-bit values converted up:
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --pass hlo-amp-comm-precision \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=PASS
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16,reduce=float32 \
// RUN:   --pass hlo-amp-comm-precision | filecheck %s --enable-var-scope --check-prefix=PASS32

// Block 0's input gradient, constrained to the batch sharding, scatter-added into the
// table. The fast mode paints it 16-bit up to the scatter; the scatter sums in bf16.
// MIXED-LABEL: func.func public @embedding_grad
// MIXED:         %[[C:.*]] = sdy.sharding_constraint %{{.*}} <@mesh, [{"fsdp"}, {}, {}]> : tensor<8x4x16xbf16>
// MIXED:         %[[R:.*]] = "stablehlo.scatter"(%{{.*}}, %{{.*}}, %[[C]])
// MIXED:           ^bb0(%{{.*}}: tensor<bf16>, %{{.*}}: tensor<bf16>):
// MIXED-NEXT:        stablehlo.add %{{.*}}, %{{.*}} : tensor<bf16>
// MIXED:         }) : (tensor<64x16xbf16>, tensor<8x4x1xi32>, tensor<8x4x16xbf16>) -> tensor<64x16xbf16>
// MIXED:         %[[UP:.*]] = stablehlo.convert %[[R]] : (tensor<64x16xbf16>) -> tensor<64x16xf32>
// MIXED:         return %[[UP]] : tensor<64x16xf32>
// F32-LABEL: func.func public @embedding_grad
// F32-NOT:     tensor<64x16xbf16>
// F32:         "stablehlo.scatter"
// F32:           ^bb0(%{{.*}}: tensor<f32>, %{{.*}}: tensor<f32>):
// F32:         }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
// F32-NOT:     tensor<64x16xbf16>
// F32:         return
module @grad_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=8]>
  func.func public @embedding_grad(%g: tensor<8x4x16xf32>, %w1: tensor<16x16xf32>, %w2: tensor<16x16xf32>, %tokens: tensor<8x4x1xi32>) -> tensor<64x16xf32> {
    %a = stablehlo.dot_general %g, %w1, contracting_dims = [2] x [1] : (tensor<8x4x16xf32>, tensor<16x16xf32>) -> tensor<8x4x16xf32>
    %b = stablehlo.dot_general %g, %w2, contracting_dims = [2] x [1] : (tensor<8x4x16xf32>, tensor<16x16xf32>) -> tensor<8x4x16xf32>
    %s = stablehlo.add %a, %b : tensor<8x4x16xf32>
    %c = sdy.sharding_constraint %s <@mesh, [{"fsdp"}, {}, {}]> : tensor<8x4x16xf32>
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %z = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<64x16xf32>
    %r = "stablehlo.scatter"(%z, %tokens, %c) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [2], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 2>, unique_indices = false}> ({
    ^bb0(%p: tensor<f32>, %q: tensor<f32>):
      %sum = stablehlo.add %p, %q : tensor<f32>
      stablehlo.return %sum : tensor<f32>
    }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
    return %r : tensor<64x16xf32>
  }
}

// -----

// The updates arrive sharded (a function argument) and 16-bit, in a private function as
// jax's `_take` transpose: summed in bf16 where the reduce precision is 16-bit.
// PASS-LABEL: func.func private @_take_0
// PASS-SAME:      (%[[I:.*]]: tensor<8x4x1xi32>, %[[U:.*]]: tensor<8x4x16xbf16>) -> tensor<64x16xf32>
// PASS:         %[[Z:.*]] = stablehlo.convert %{{.*}} : (tensor<64x16xf32>) -> tensor<64x16xbf16>
// PASS:         %[[R:.*]] = "stablehlo.scatter"(%[[Z]], %[[I]], %[[U]])
// PASS:         }) : (tensor<64x16xbf16>, tensor<8x4x1xi32>, tensor<8x4x16xbf16>) -> tensor<64x16xbf16>
// PASS:         %[[UP:.*]] = stablehlo.convert %[[R]] : (tensor<64x16xbf16>) -> tensor<64x16xf32>
// PASS:         return %[[UP]] : tensor<64x16xf32>
// PASS32-LABEL: func.func private @_take_0
// PASS32:         %[[UP:.*]] = stablehlo.convert %{{.*}} : (tensor<8x4x16xbf16>) -> tensor<8x4x16xf32>
// PASS32:         "stablehlo.scatter"(%{{.*}}, %{{.*}}, %[[UP]])
// PASS32:         }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
module @sharded_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=8]>
  func.func public @main(%u: tensor<8x4x16xbf16> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}, {}]>}, %tokens: tensor<8x4x1xi32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}, {}]>}) -> tensor<64x16xf32> {
    %r = call @_take_0(%tokens, %u) : (tensor<8x4x1xi32>, tensor<8x4x16xbf16>) -> tensor<64x16xf32>
    return %r : tensor<64x16xf32>
  }
  func.func private @_take_0(%tokens: tensor<8x4x1xi32>, %u: tensor<8x4x16xbf16>) -> tensor<64x16xf32> {
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %z = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<64x16xf32>
    %up = stablehlo.convert %u : (tensor<8x4x16xbf16>) -> tensor<8x4x16xf32>
    %r = "stablehlo.scatter"(%z, %tokens, %up) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [2], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 2>, unique_indices = false}> ({
    ^bb0(%p: tensor<f32>, %q: tensor<f32>):
      %sum = stablehlo.add %p, %q : tensor<f32>
      stablehlo.return %sum : tensor<f32>
    }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
    return %r : tensor<64x16xf32>
  }
}

// -----

// Left in f32 by the pass: the same scatter on one device's data (nothing is summed
// across devices), a scatter whose body is not an add (no sum), an add scatter whose
// indices name one position (no two updates meet), and one into a computed buffer (an
// accumulator: converting it would round it too).
// PASS-LABEL: func.func public @replicated
// PASS:         }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
// PASS-LABEL: func.func public @max_scatter
// PASS:         stablehlo.maximum %{{.*}}, %{{.*}} : tensor<f32>
// PASS:         }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
// PASS-LABEL: func.func public @one_position
// PASS:         }) : (tensor<8x64xf32>, tensor<8x1xi32>, tensor<8xf32>) -> tensor<8x64xf32>
// PASS-LABEL: func.func public @into_a_buffer
// PASS:         }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
module @kept_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=8]>
  func.func public @replicated(%u: tensor<8x4x16xbf16>, %tokens: tensor<8x4x1xi32>) -> tensor<64x16xf32> {
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %z = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<64x16xf32>
    %up = stablehlo.convert %u : (tensor<8x4x16xbf16>) -> tensor<8x4x16xf32>
    %r = "stablehlo.scatter"(%z, %tokens, %up) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [2], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 2>, unique_indices = false}> ({
    ^bb0(%p: tensor<f32>, %q: tensor<f32>):
      %sum = stablehlo.add %p, %q : tensor<f32>
      stablehlo.return %sum : tensor<f32>
    }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
    return %r : tensor<64x16xf32>
  }
  func.func public @max_scatter(%u: tensor<8x4x16xbf16> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}, {}]>}, %tokens: tensor<8x4x1xi32>) -> tensor<64x16xf32> {
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %z = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<64x16xf32>
    %up = stablehlo.convert %u : (tensor<8x4x16xbf16>) -> tensor<8x4x16xf32>
    %r = "stablehlo.scatter"(%z, %tokens, %up) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [2], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 2>, unique_indices = false}> ({
    ^bb0(%p: tensor<f32>, %q: tensor<f32>):
      %m = stablehlo.maximum %p, %q : tensor<f32>
      stablehlo.return %m : tensor<f32>
    }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
    return %r : tensor<64x16xf32>
  }
  func.func public @one_position(%u: tensor<8xbf16> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}]>}, %labels: tensor<8x1xi32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}]>}) -> tensor<8x64xf32> {
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %z = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<8x64xf32>
    %up = stablehlo.convert %u : (tensor<8xbf16>) -> tensor<8xf32>
    %r = "stablehlo.scatter"(%z, %labels, %up) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [1], input_batching_dims = [0], scatter_indices_batching_dims = [0], scatter_dims_to_operand_dims = [1], index_vector_dim = 1>, unique_indices = false}> ({
    ^bb0(%p: tensor<f32>, %q: tensor<f32>):
      %sum = stablehlo.add %p, %q : tensor<f32>
      stablehlo.return %sum : tensor<f32>
    }) : (tensor<8x64xf32>, tensor<8x1xi32>, tensor<8xf32>) -> tensor<8x64xf32>
    return %r : tensor<8x64xf32>
  }
  func.func public @into_a_buffer(%acc: tensor<64x16xf32>, %u: tensor<8x4x16xbf16> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}, {}]>}, %tokens: tensor<8x4x1xi32>) -> tensor<64x16xf32> {
    %up = stablehlo.convert %u : (tensor<8x4x16xbf16>) -> tensor<8x4x16xf32>
    %r = "stablehlo.scatter"(%acc, %tokens, %up) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [2], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 2>, unique_indices = false}> ({
    ^bb0(%p: tensor<f32>, %q: tensor<f32>):
      %sum = stablehlo.add %p, %q : tensor<f32>
      stablehlo.return %sum : tensor<f32>
    }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
    return %r : tensor<64x16xf32>
  }
}
