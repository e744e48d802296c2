// Communication precision (hlo-amp-comm-precision): a 16-bit convert moves above the
// sharding constraints, reshapes, transposes, broadcasts and data-moving collectives
// before it when every reader is such a convert (the same values, half the bytes to
// move); reduce=bfloat16 makes dots whose contracting dimension is sharded return bf16.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-comm-precision | filecheck %s --enable-var-scope
// The whole pipeline, accurate and fast mode:
// RUN: hlo-amp-opt %s --split-input-file --policy bf16 | filecheck %s --enable-var-scope --check-prefix=BF16
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 | filecheck %s --enable-var-scope --check-prefix=MIXED
// RUN: hlo-amp-opt %s --split-input-file --policy bf16,reduce=bfloat16 --pass hlo-amp-comm-precision \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=REDUCE
// The f32 preset changes nothing, a program's own converts included:
// RUN: hlo-amp-opt %s --split-input-file --policy f32 --pass hlo-amp-comm-precision \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=F32
// Idempotence:
// RUN: hlo-amp-opt %s --split-input-file --policy bf16 | hlo-amp-opt --split-input-file --policy bf16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=BF16

// Sequence-parallel K: computed in f32, constrained to replicated, transposed, read by a
// bf16 dot. The convert goes before the constraint: the all-gather XLA's partitioner
// puts there moves bf16 (jax-ml/jax#23543).
// BF16-LABEL: func.func public @kv
// BF16:         %[[K:.*]] = stablehlo.cosine
// BF16:         %[[K16:.*]] = stablehlo.convert %[[K]] : (tensor<256x64xf32>) -> tensor<256x64xbf16>
// BF16:         %[[C:.*]] = sdy.sharding_constraint %[[K16]] <@mesh, [{}, {}]> : tensor<256x64xbf16>
// BF16:         %[[T:.*]] = stablehlo.transpose %[[C]], dims = [1, 0] : (tensor<256x64xbf16>) -> tensor<64x256xbf16>
// BF16:         stablehlo.dot_general %{{.*}}, %[[T]]
// BF16-NOT:     sdy.sharding_constraint {{.*}} : tensor<256x64xf32>
// MIXED-LABEL: func.func public @kv
// MIXED:         sdy.sharding_constraint %{{.*}} <@mesh, [{}, {}]> : tensor<256x64xbf16>
// MIXED-NOT:     sdy.sharding_constraint {{.*}} : tensor<256x64xf32>
module @kv_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["seq"=8]>
  func.func public @kv(%x: tensor<256x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"seq"}, {}]>}) -> tensor<256x256xf32> {
    %q = stablehlo.sine %x : tensor<256x64xf32>
    %k = stablehlo.cosine %x : tensor<256x64xf32>
    %c = sdy.sharding_constraint %k <@mesh, [{}, {}]> : tensor<256x64xf32>
    %t = stablehlo.transpose %c, dims = [1, 0] : (tensor<256x64xf32>) -> tensor<64x256xf32>
    %s = stablehlo.dot_general %q, %t, contracting_dims = [1] x [0] : (tensor<256x64xf32>, tensor<64x256xf32>) -> tensor<256x256xf32>
    return %s : tensor<256x256xf32>
  }
}

// -----

// A shard_map body: the convert moves above the reshape and the all_gather (data
// movement) but not above the all_reduce (a sum: bf16 would round each addition).
// CHECK-LABEL: func.func public @shard_map_body
// CHECK:         sdy.manual_computation
// CHECK:           %[[S:.*]] = stablehlo.sine
// CHECK:           %[[S16:.*]] = stablehlo.convert %[[S]] : (tensor<8x16xf32>) -> tensor<8x16xbf16>
// CHECK:           %[[G:.*]] = "stablehlo.all_gather"(%[[S16]]) {{.*}} : (tensor<8x16xbf16>) -> tensor<64x16xbf16>
// CHECK:           %[[R:.*]] = stablehlo.reshape %[[G]] : (tensor<64x16xbf16>) -> tensor<16x64xbf16>
// CHECK:           %[[P:.*]] = "stablehlo.collective_permute"(%{{.*}}) {{.*}} : (tensor<8x16xbf16>) -> tensor<8x16xbf16>
// CHECK:           %[[A:.*]] = "stablehlo.all_reduce"(%[[S]])
// CHECK:           }) : (tensor<8x16xf32>) -> tensor<8x16xf32>
// CHECK:           stablehlo.convert %[[A]] : (tensor<8x16xf32>) -> tensor<8x16xbf16>
module @shard_map_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["seq"=8]>
  func.func public @shard_map_body(%arg0: tensor<64x16xf32>) -> tensor<64x16xf32> {
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"seq"}, {}]>] out_shardings=[<@mesh, [{"seq"}, {}]>] manual_axes={"seq"} (%x: tensor<8x16xf32>) {
      %s = stablehlo.sine %x : tensor<8x16xf32>
      %g = "stablehlo.all_gather"(%s) <{all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1, 2, 3, 4, 5, 6, 7]]> : tensor<1x8xi64>, use_global_device_ids}> : (tensor<8x16xf32>) -> tensor<64x16xf32>
      %r = stablehlo.reshape %g : (tensor<64x16xf32>) -> tensor<16x64xf32>
      %r16 = stablehlo.convert %r : (tensor<16x64xf32>) -> tensor<16x64xbf16>
      %p = "stablehlo.collective_permute"(%s) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, source_target_pairs = dense<[[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6, 7], [7, 0]]> : tensor<8x2xi64>}> : (tensor<8x16xf32>) -> tensor<8x16xf32>
      %p16 = stablehlo.convert %p : (tensor<8x16xf32>) -> tensor<8x16xbf16>
      %a = "stablehlo.all_reduce"(%s) <{channel_handle = #stablehlo.channel_handle<handle = 3, type = 1>, replica_groups = dense<[[0, 1, 2, 3, 4, 5, 6, 7]]> : tensor<1x8xi64>, use_global_device_ids}> ({
      ^bb0(%l: tensor<f32>, %rr: tensor<f32>):
        %sum = stablehlo.add %l, %rr : tensor<f32>
        stablehlo.return %sum : tensor<f32>
      }) : (tensor<8x16xf32>) -> tensor<8x16xf32>
      %a16 = stablehlo.convert %a : (tensor<8x16xf32>) -> tensor<8x16xbf16>
      %d = stablehlo.dot_general %p16, %r16, contracting_dims = [1] x [0] : (tensor<8x16xbf16>, tensor<16x64xbf16>) -> tensor<8x64xf32>
      %e = stablehlo.dot_general %a16, %r16, contracting_dims = [1] x [0] : (tensor<8x16xbf16>, tensor<16x64xbf16>) -> tensor<8x64xf32>
      %f = stablehlo.add %d, %e : tensor<8x64xf32>
      %o = stablehlo.slice %f [0:8, 0:16] : (tensor<8x64xf32>) -> tensor<8x16xf32>
      sdy.return %o : tensor<8x16xf32>
    } : (tensor<64x16xf32>) -> tensor<64x16xf32>
    return %0 : tensor<64x16xf32>
  }
}

// -----

// GSPMD's form of a constraint (custom_call @Sharding), then a broadcast; an f32 reader
// besides the convert keeps the second constraint f32 (moving would need both copies).
// CHECK-LABEL: func.func public @gspmd
// CHECK:         %[[V16:.*]] = stablehlo.convert %arg0 : (tensor<4x8xf32>) -> tensor<4x8xbf16>
// CHECK:         %[[C:.*]] = stablehlo.custom_call @Sharding(%[[V16]]) {mhlo.sharding = "{replicated}"} : (tensor<4x8xbf16>) -> tensor<4x8xbf16>
// CHECK:         %[[B:.*]] = stablehlo.broadcast_in_dim %[[C]], dims = [1, 2] : (tensor<4x8xbf16>) -> tensor<2x4x8xbf16>
// CHECK:         %[[K:.*]] = stablehlo.custom_call @Sharding(%arg1) {mhlo.sharding = "{replicated}"} : (tensor<4x8xf32>) -> tensor<4x8xf32>
// CHECK:         stablehlo.convert %[[K]] : (tensor<4x8xf32>) -> tensor<4x8xbf16>
// CHECK:         stablehlo.exponential %[[K]]
// F32-LABEL: func.func public @gspmd
// F32:         stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{replicated}"} : (tensor<4x8xf32>) -> tensor<4x8xf32>
func.func public @gspmd(%arg0: tensor<4x8xf32>, %arg1: tensor<4x8xf32>) -> (tensor<2x4x8xbf16>, tensor<4x8xbf16>, tensor<4x8xf32>) {
  %c = stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{replicated}"} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %b = stablehlo.broadcast_in_dim %c, dims = [1, 2] : (tensor<4x8xf32>) -> tensor<2x4x8xf32>
  %b16 = stablehlo.convert %b : (tensor<2x4x8xf32>) -> tensor<2x4x8xbf16>
  %k = stablehlo.custom_call @Sharding(%arg1) {mhlo.sharding = "{replicated}"} : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %k16 = stablehlo.convert %k : (tensor<4x8xf32>) -> tensor<4x8xbf16>
  %e = stablehlo.exponential %k : tensor<4x8xf32>
  return %b16, %k16, %e : tensor<2x4x8xbf16>, tensor<4x8xbf16>, tensor<4x8xf32>
}

// -----

// Data-parallel weight gradient: x and dy are sharded over "data" on the batch, the dot
// contracts the batch, so XLA's partitioner all-reduces its partial results in the
// dot's result type. reduce=bfloat16 makes that bf16 (a convert back to f32 after);
// the default leaves it f32. The forward dot (contracting the unsharded features) and
// the FSDP dot (w sharded over "data" on its contracting dim while x uses "data" on its
// batch: XLA gathers w) keep f32 results.
// REDUCE-LABEL: func.func public @weight_gradient
// REDUCE:         %[[F:.*]] = stablehlo.dot_general %{{.*}}, %{{.*}}, contracting_dims = [1] x [0] : (tensor<16x8xbf16>, tensor<8x4xbf16>) -> tensor<16x4xf32>
// REDUCE:         %[[G:.*]] = stablehlo.dot_general %{{.*}}, %{{.*}}, contracting_dims = [0] x [0] : (tensor<16x8xbf16>, tensor<16x4xbf16>) -> tensor<8x4xbf16>
// REDUCE:         %[[G32:.*]] = stablehlo.convert %[[G]] : (tensor<8x4xbf16>) -> tensor<8x4xf32>
// REDUCE:         return %[[F]], %[[G32]]
// CHECK-LABEL: func.func public @weight_gradient
// CHECK:         stablehlo.dot_general {{.*}} -> tensor<16x4xf32>
// CHECK:         stablehlo.dot_general {{.*}} -> tensor<8x4xf32>
// BF16-LABEL: func.func public @weight_gradient
// BF16:         stablehlo.dot_general {{.*}} : (tensor<16x8xbf16>, tensor<8x4xbf16>) -> tensor<16x4xf32>
// BF16:         stablehlo.dot_general {{.*}} : (tensor<16x8xbf16>, tensor<16x4xbf16>) -> tensor<8x4xf32>
module @dp_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["data"=8]>
  func.func public @weight_gradient(%x: tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}]>}, %w: tensor<8x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}]>}, %dy: tensor<16x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}]>}) -> (tensor<16x4xf32>, tensor<8x4xf32>) {
    %x16 = stablehlo.convert %x : (tensor<16x8xf32>) -> tensor<16x8xbf16>
    %w16 = stablehlo.convert %w : (tensor<8x4xf32>) -> tensor<8x4xbf16>
    %dy16 = stablehlo.convert %dy : (tensor<16x4xf32>) -> tensor<16x4xbf16>
    %y = stablehlo.dot_general %x16, %w16, contracting_dims = [1] x [0] : (tensor<16x8xbf16>, tensor<8x4xbf16>) -> tensor<16x4xf32>
    %dw = stablehlo.dot_general %x16, %dy16, contracting_dims = [0] x [0] : (tensor<16x8xbf16>, tensor<16x4xbf16>) -> tensor<8x4xf32>
    return %y, %dw : tensor<16x4xf32>, tensor<8x4xf32>
  }
}

// -----

// An embedding lookup read only by a bf16 convert stays as written: above the gather the
// convert would convert the whole table to use a few rows.
// CHECK-LABEL: func.func public @embedding
// CHECK:         %[[G:.*]] = "stablehlo.gather"(%arg0, %arg1)
// CHECK-SAME:      (tensor<16x8xf32>, tensor<4x1xi32>) -> tensor<4x8xf32>
// CHECK:         stablehlo.convert %[[G]] : (tensor<4x8xf32>) -> tensor<4x8xbf16>
func.func public @embedding(%table: tensor<16x8xf32>, %ids: tensor<4x1xi32>) -> tensor<4x8xbf16> {
  %g = "stablehlo.gather"(%table, %ids) <{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, 8>}> : (tensor<16x8xf32>, tensor<4x1xi32>) -> tensor<4x8xf32>
  %g16 = stablehlo.convert %g : (tensor<4x8xf32>) -> tensor<4x8xbf16>
  return %g16 : tensor<4x8xbf16>
}
