// The fast mode (hlo-amp-propagate) on what a sharded train step adds to a model: sharding
// constraints on the residual stream, an embedding lookup and its gradient's scatter-add,
// and jax.checkpoint's optimization barrier. A constraint is data movement (clear); the
// lookup's result, which a painted residual add and the norm's f32 sum read, is stored in
// 16 bit, so the table is converted before the gather (the same values: rounding commutes
// with picking rows); the gradient reaching an add scatter is 16-bit up to it and the
// scatter sums in f32; each operand-result pair of a barrier is a link.
//
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope
// Idempotence: the pipeline run on its own output changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --debug-info \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | hlo-amp-opt --split-input-file --policy mixed_bfloat16 \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope
// A rule that keeps the barrier as written: it reads and returns f32.
// RUN: hlo-amp-opt %s --split-input-file --policy 'mixed_bfloat16,op:optimization_barrier=float32' \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=KEPT

// CHECK-LABEL: func.func public @residual
// CHECK-SAME:    (%[[TABLE:.*]]: tensor<64x16xf32>, %[[TOK:.*]]: tensor<8x4x1xi32>
// CHECK:         %[[T16:.*]] = stablehlo.convert %[[TABLE]] : (tensor<64x16xf32>) -> tensor<64x16xbf16>
// CHECK:         %[[E:.*]] = "stablehlo.gather"(%[[T16]], %[[TOK]]) {{.*}} -> tensor<8x4x16xbf16>
// CHECK:         %[[H0:.*]] = sdy.sharding_constraint %[[E]] <@mesh, [{"fsdp"}, {}, {}]> : tensor<8x4x16xbf16>
// CHECK:         %[[UP:.*]] = stablehlo.convert %[[H0]] : (tensor<8x4x16xbf16>) -> tensor<8x4x16xf32>
// CHECK:         stablehlo.multiply %[[UP]], %[[UP]] : tensor<8x4x16xf32>
// CHECK:         %[[D1:.*]] = stablehlo.dot_general %[[H0]], {{.*}} -> tensor<8x4x16xbf16>
// CHECK:         %[[H1:.*]] = stablehlo.add %[[H0]], %[[D1]] : tensor<8x4x16xbf16>
// CHECK:         %[[C1:.*]] = sdy.sharding_constraint %[[H1]] <@mesh, [{"fsdp"}, {}, {}]> : tensor<8x4x16xbf16>
// CHECK:         stablehlo.dot_general %[[C1]], {{.*}} -> tensor<8x4x16xbf16>
// CHECK-NOT:     sdy.sharding_constraint {{.*}} : tensor<8x4x16xf32>
module @residual_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=8]>
  func.func public @residual(%table: tensor<64x16xf32>, %tokens: tensor<8x4x1xi32>, %w1: tensor<16x16xf32>, %w2: tensor<16x16xf32>) -> (tensor<8x4x16xf32>, tensor<8x4xf32>) {
    %e = "stablehlo.gather"(%table, %tokens) <{dimension_numbers = #stablehlo.gather<offset_dims = [2], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 2>, indices_are_sorted = false, slice_sizes = array<i64: 1, 16>}> : (tensor<64x16xf32>, tensor<8x4x1xi32>) -> tensor<8x4x16xf32>
    %h0 = sdy.sharding_constraint %e <@mesh, [{"fsdp"}, {}, {}]> : tensor<8x4x16xf32>
    %sq = stablehlo.multiply %h0, %h0 : tensor<8x4x16xf32>
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %ss = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [2] : (tensor<8x4x16xf32>, tensor<f32>) -> tensor<8x4xf32>
    %d1 = stablehlo.dot_general %h0, %w1, contracting_dims = [2] x [0] : (tensor<8x4x16xf32>, tensor<16x16xf32>) -> tensor<8x4x16xf32>
    %h1 = stablehlo.add %h0, %d1 : tensor<8x4x16xf32>
    %c1 = sdy.sharding_constraint %h1 <@mesh, [{"fsdp"}, {}, {}]> : tensor<8x4x16xf32>
    %d2 = stablehlo.dot_general %c1, %w2, contracting_dims = [2] x [0] : (tensor<8x4x16xf32>, tensor<16x16xf32>) -> tensor<8x4x16xf32>
    %h2 = stablehlo.add %c1, %d2 : tensor<8x4x16xf32>
    return %h2, %ss : tensor<8x4x16xf32>, tensor<8x4xf32>
  }
}

// -----

// The gradient of block 0's input, which only the embedding's scatter-add reads: 16-bit
// up to the scatter (as between two matrix ops), converted up by it, summed in f32.
// CHECK-LABEL: func.func public @embedding_grad
// CHECK:         %[[A:.*]] = stablehlo.dot_general {{.*}} -> tensor<8x4x16xbf16>
// CHECK:         %[[B:.*]] = stablehlo.dot_general {{.*}} -> tensor<8x4x16xbf16>
// CHECK:         %[[S:.*]] = stablehlo.add %[[A]], %[[B]] : tensor<8x4x16xbf16>
// CHECK:         %[[C:.*]] = sdy.sharding_constraint %[[S]] <@mesh, [{"fsdp"}, {}, {}]> : tensor<8x4x16xbf16>
// CHECK:         %[[UP:.*]] = stablehlo.convert %[[C]] : (tensor<8x4x16xbf16>) -> tensor<8x4x16xf32>
// CHECK:         "stablehlo.scatter"(%{{.*}}, %{{.*}}, %[[UP]])
// CHECK:         }) : (tensor<64x16xf32>, tensor<8x4x1xi32>, tensor<8x4x16xf32>) -> tensor<64x16xf32>
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

// jax.checkpoint's barrier: the activation between two matrix ops crosses it in 16 bit;
// the f32 sum beside it stays f32.
// CHECK-LABEL: func.func public @remat
// CHECK:         %[[T:.*]] = stablehlo.tanh %{{.*}} : tensor<8x16xbf16>
// CHECK:         %[[SUM:.*]] = stablehlo.reduce
// CHECK:         %[[B:.*]]:2 = stablehlo.optimization_barrier %[[T]], %[[SUM]] : tensor<8x16xbf16>, tensor<8xf32>
// CHECK:         stablehlo.dot_general %[[B]]#0, {{.*}} : (tensor<8x16xbf16>, tensor<16x16xbf16>) -> tensor<8x16xf32>
// CHECK:         stablehlo.exponential %[[B]]#1 : tensor<8xf32>
// KEPT-LABEL:  func.func public @remat
// KEPT:          %[[T:.*]] = stablehlo.tanh %{{.*}} : tensor<8x16xbf16>
// KEPT:          %[[UP:.*]] = stablehlo.convert %[[T]] : (tensor<8x16xbf16>) -> tensor<8x16xf32>
// KEPT:          stablehlo.optimization_barrier %[[UP]], %{{.*}} : tensor<8x16xf32>, tensor<8xf32>
module @remat_module {
  func.func public @remat(%x: tensor<8x16xf32>, %w1: tensor<16x16xf32>, %w2: tensor<16x16xf32>) -> (tensor<8x16xf32>, tensor<8xf32>) {
    %d1 = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    %t = stablehlo.tanh %d1 : tensor<8x16xf32>
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %sum = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<8x16xf32>, tensor<f32>) -> tensor<8xf32>
    %b:2 = stablehlo.optimization_barrier %t, %sum : tensor<8x16xf32>, tensor<8xf32>
    %d2 = stablehlo.dot_general %b#0, %w2, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    %e = stablehlo.exponential %b#1 : tensor<8xf32>
    return %d2, %e : tensor<8x16xf32>, tensor<8xf32>
  }
}
