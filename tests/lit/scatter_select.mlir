// One-position add scatters into a constant become an elementwise select (the mixed_*
// modes; passes/scatter_select.py): the gradient of take_along_axis (a label pick, with
// batching dims) and of a static pick along the last dim. Scatters that can meet, or
// that add into a computed operand, stay.
//
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 \
// RUN:   --pass hlo-amp-scatter-select | filecheck %s --enable-var-scope
// The whole pipeline of the mixed mode includes it; the accurate mode does not.
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 \
// RUN:   | filecheck %s --check-prefix=MIXED
// RUN: hlo-amp-opt %s --split-input-file --policy bf16 \
// RUN:   | filecheck %s --check-prefix=ACCURATE
// XLA:TPU writes such a scatter as a select itself before partitioning: no sharding.
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target tpu \
// RUN:   --pass hlo-amp-scatter-select | filecheck %s --check-prefix=TPU

// CHECK-LABEL: func.func public @label_pick_grad
// CHECK-SAME: (%[[IDX:.*]]: tensor<8x16x1x1xi32>, %[[UPD:.*]]: tensor<8x16x1xf32>)
// CHECK-NOT: stablehlo.scatter
// CHECK: %[[ZEROS:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [] : (tensor<f32>) -> tensor<8x16x32xf32>
// CHECK: %[[PIECE:.*]] = stablehlo.slice %[[IDX]] [0:8, 0:16, 0:1, 0:1]
// CHECK: %[[ROWS:.*]] = stablehlo.reshape %[[PIECE]] : (tensor<8x16x1x1xi32>) -> tensor<8x16xi32>
// CHECK: %[[POS:.*]] = stablehlo.broadcast_in_dim %[[ROWS]], dims = [0, 1] : (tensor<8x16xi32>) -> tensor<8x16x32xi32>
// CHECK: %[[IOTA:.*]] = stablehlo.iota dim = 2 : tensor<8x16x32xi32>
// CHECK: %[[MASK:.*]] = stablehlo.compare EQ, %[[IOTA]], %[[POS]]
// CHECK: %[[U:.*]] = stablehlo.reshape %[[UPD]] : (tensor<8x16x1xf32>) -> tensor<8x16xf32>
// CHECK: %[[PLACED:.*]] = stablehlo.broadcast_in_dim %[[U]], dims = [0, 1] : (tensor<8x16xf32>) -> tensor<8x16x32xf32>
// CHECK: %[[SUM:.*]] = stablehlo.add %[[ZEROS]], %[[PLACED]] : tensor<8x16x32xf32>
// CHECK: %[[OUT:.*]] = stablehlo.select %[[MASK]], %[[SUM]], %[[ZEROS]]
// CHECK: return %[[OUT]]
// MIXED-LABEL: func.func public @label_pick_grad
// MIXED-NOT: stablehlo.scatter
// MIXED: stablehlo.select
// ACCURATE-LABEL: func.func public @label_pick_grad
// ACCURATE: stablehlo.scatter
func.func public @label_pick_grad(%idx: tensor<8x16x1x1xi32>, %upd: tensor<8x16x1xf32>) -> tensor<8x16x32xf32> {
  %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x16x32xf32>
  %1 = "stablehlo.scatter"(%0, %idx, %upd) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [2], input_batching_dims = [0, 1], scatter_indices_batching_dims = [0, 1], scatter_dims_to_operand_dims = [2], index_vector_dim = 3>, unique_indices = false}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %2 = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %2 : tensor<f32>
  }) : (tensor<8x16x32xf32>, tensor<8x16x1x1xi32>, tensor<8x16x1xf32>) -> tensor<8x16x32xf32>
  return %1 : tensor<8x16x32xf32>
}

// -----

// The transpose of x[..., k] with a traced k: a window of the two leading dims at one
// position of the last.
// CHECK-LABEL: func.func public @static_pick_grad
// CHECK-SAME: (%[[IDX:.*]]: tensor<1xi32>, %[[UPD:.*]]: tensor<8x16xf32>)
// CHECK-NOT: stablehlo.scatter
// CHECK: %[[ROW:.*]] = stablehlo.reshape %{{.*}} : (tensor<1xi32>) -> tensor<i32>
// CHECK: %[[POS:.*]] = stablehlo.broadcast_in_dim %[[ROW]], dims = [] : (tensor<i32>) -> tensor<8x16x4xi32>
// CHECK: %[[IOTA:.*]] = stablehlo.iota dim = 2 : tensor<8x16x4xi32>
// CHECK: %[[MASK:.*]] = stablehlo.compare EQ, %[[IOTA]], %[[POS]]
// CHECK: %[[PLACED:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [0, 1] : (tensor<8x16xf32>) -> tensor<8x16x4xf32>
// CHECK: stablehlo.select %[[MASK]]
func.func public @static_pick_grad(%idx: tensor<1xi32>, %upd: tensor<8x16xf32>) -> tensor<8x16x4xf32> {
  %cst = stablehlo.constant dense<0.000000e+00> : tensor<8x16x4xf32>
  %1 = "stablehlo.scatter"(%cst, %idx, %upd) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [0, 1], inserted_window_dims = [2], scatter_dims_to_operand_dims = [2]>, unique_indices = false}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %2 = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %2 : tensor<f32>
  }) : (tensor<8x16x4xf32>, tensor<1xi32>, tensor<8x16xf32>) -> tensor<8x16x4xf32>
  return %1 : tensor<8x16x4xf32>
}

// -----

// An embedding's gradient: two rows may name one position. Stays a scatter.
// CHECK-LABEL: func.func public @embedding_grad
// CHECK: stablehlo.scatter
func.func public @embedding_grad(%idx: tensor<8x16x1xi32>, %upd: tensor<8x16x64xf32>) -> tensor<100x64xf32> {
  %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<100x64xf32>
  %1 = "stablehlo.scatter"(%0, %idx, %upd) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [2], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 2>, unique_indices = false}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %2 = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %2 : tensor<f32>
  }) : (tensor<100x64xf32>, tensor<8x16x1xi32>, tensor<8x16x64xf32>) -> tensor<100x64xf32>
  return %1 : tensor<100x64xf32>
}

// -----

// One position, but into a computed buffer (a cache updated in place): the scatter
// touches one slot, a select would rewrite the whole buffer. Stays.
// CHECK-LABEL: func.func public @into_a_buffer
// CHECK: stablehlo.scatter
func.func public @into_a_buffer(%buf: tensor<8x16x32xf32>, %idx: tensor<8x16x1x1xi32>, %upd: tensor<8x16x1xf32>) -> tensor<8x16x32xf32> {
  %1 = "stablehlo.scatter"(%buf, %idx, %upd) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [2], input_batching_dims = [0, 1], scatter_indices_batching_dims = [0, 1], scatter_dims_to_operand_dims = [2], index_vector_dim = 3>, unique_indices = false}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %2 = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %2 : tensor<f32>
  }) : (tensor<8x16x32xf32>, tensor<8x16x1x1xi32>, tensor<8x16x1xf32>) -> tensor<8x16x32xf32>
  return %1 : tensor<8x16x32xf32>
}

// -----

// A partitioned module (issue 48): the label pick's indices are sharded on the batch.
// Shardy passes that sharding to the scatter's result along its batching dims early in
// its propagation, to a select only through the broadcast of the indices, late; the
// select carries the sharding Shardy gives the scatter, every dimension open.
// CHECK-LABEL: func.func public @main
// CHECK-NOT: stablehlo.scatter
// CHECK: %[[SEL:.*]] = stablehlo.select
// CHECK: %[[KEPT:.*]] = sdy.sharding_constraint %[[SEL]] <@mesh, [{"fsdp", ?}, {?}, {?}]> : tensor<8x16x32xf32>
// CHECK: return %[[KEPT]]
// MIXED-LABEL: func.func public @main
// MIXED: sdy.sharding_constraint %{{.*}} <@mesh, [{"fsdp", ?}, {?}, {?}]> : tensor<8x16x32xf32>
// TPU-LABEL: func.func public @main
// TPU: %[[SEL:.*]] = stablehlo.select
// TPU-NOT: sdy.sharding_constraint
// TPU: return %[[SEL]]
module @sharded attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=4, "tp"=2]>
  func.func public @main(%idx: tensor<8x16x1x1xi32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}, {}, {}]>}, %upd: tensor<8x16x1xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}, {}]>}) -> tensor<8x16x32xf32> {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x16x32xf32>
    %1 = "stablehlo.scatter"(%0, %idx, %upd) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [2], input_batching_dims = [0, 1], scatter_indices_batching_dims = [0, 1], scatter_dims_to_operand_dims = [2], index_vector_dim = 3>, unique_indices = false}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %2 = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %2 : tensor<f32>
    }) : (tensor<8x16x32xf32>, tensor<8x16x1x1xi32>, tensor<8x16x1xf32>) -> tensor<8x16x32xf32>
    return %1 : tensor<8x16x32xf32>
  }
}

// -----

// Partitioned with GSPMD's shardings (no Shardy mesh): the sharding the scatter's result
// gets cannot be read here, so the scatter stays and keeps the plan as it is.
// CHECK-LABEL: func.func public @main
// CHECK: stablehlo.scatter
// CHECK-NOT: stablehlo.select
module @gspmd attributes {mhlo.num_partitions = 8 : i32} {
  func.func public @main(%idx: tensor<8x16x1x1xi32> {mhlo.sharding = "{devices=[8,1,1,1]<=[8]}"}, %upd: tensor<8x16x1xf32> {mhlo.sharding = "{devices=[8,1,1]<=[8]}"}) -> tensor<8x16x32xf32> {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x16x32xf32>
    %1 = "stablehlo.scatter"(%0, %idx, %upd) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [2], input_batching_dims = [0, 1], scatter_indices_batching_dims = [0, 1], scatter_dims_to_operand_dims = [2], index_vector_dim = 3>, unique_indices = false}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %2 = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %2 : tensor<f32>
    }) : (tensor<8x16x32xf32>, tensor<8x16x1x1xi32>, tensor<8x16x1xf32>) -> tensor<8x16x32xf32>
    return %1 : tensor<8x16x32xf32>
  }
}
