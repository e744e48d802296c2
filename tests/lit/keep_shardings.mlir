// The converts the pipeline writes of values with a given sharding keep it
// (hlo-amp-keep-shardings; issue 48): a bf16 copy of a replicated argument stays
// replicated, as the argument the f32 program read, where propagation could otherwise
// shard it on a free mesh axis. Not the program's own converts, not a sharding that
// uses every mesh axis (propagation gives the copy that one), not an unpartitioned
// module.
// RUN: hlo-amp-opt %s --split-input-file --policy bf16 | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target gpu \
// RUN:   | filecheck %s --enable-var-scope
// The pass alone leaves a program as it is: its converts are the program's own.
// RUN: hlo-amp-opt %s --split-input-file --policy bf16 --pass hlo-amp-keep-shardings \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=ALONE
// Idempotence:
// RUN: hlo-amp-opt %s --split-input-file --policy bf16 | hlo-amp-opt --split-input-file \
// RUN:   --policy bf16 | filecheck %s --enable-var-scope

// %x is split on fsdp (tp free), %w replicated, %v on both axes; %u is replicated and the
// program converts it itself.
// CHECK-LABEL: func.func public @main
// CHECK-SAME: (%[[X:.*]]: tensor<8x16xf32> {{.*}}, %[[W:.*]]: tensor<16x32xf32> {{.*}}, %[[V:.*]]: tensor<16x32xf32> {{.*}}, %[[U:.*]]: tensor<16x32xf32> {{.*}})
// CHECK-DAG: %[[X16:.*]] = stablehlo.convert %[[X]] : (tensor<8x16xf32>) -> tensor<8x16xbf16>
// CHECK-DAG: %[[XK:.*]] = sdy.sharding_constraint %[[X16]] <@mesh, [{"fsdp"}, {}]> : tensor<8x16xbf16>
// CHECK-DAG: %[[W16:.*]] = stablehlo.convert %[[W]] : (tensor<16x32xf32>) -> tensor<16x32xbf16>
// CHECK-DAG: %[[WK:.*]] = sdy.sharding_constraint %[[W16]] <@mesh, [{}, {}]> : tensor<16x32xbf16>
// CHECK-DAG: %[[V16:.*]] = stablehlo.convert %[[V]] : (tensor<16x32xf32>) -> tensor<16x32xbf16>
// CHECK-DAG: %[[U16:.*]] = stablehlo.convert %[[U]] : (tensor<16x32xf32>) -> tensor<16x32xbf16>
// CHECK-DAG: stablehlo.dot_general %[[XK]], %[[WK]]
// CHECK-DAG: stablehlo.dot_general %[[XK]], %[[V16]]
// CHECK-NOT: sdy.sharding_constraint %[[V16]]
// CHECK-NOT: sdy.sharding_constraint %[[U16]]
// CHECK: return
// ALONE-LABEL: func.func public @main
// ALONE-NOT: sdy.sharding_constraint
// ALONE: return
module @sharded attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=4, "tp"=2]>
  func.func public @main(%x: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}]>},
                         %w: tensor<16x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>},
                         %v: tensor<16x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {"tp"}]>},
                         %u: tensor<16x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>})
      -> (tensor<8x32xf32>, tensor<8x32xf32>, tensor<16x32xbf16>) {
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x32xf32>) -> tensor<8x32xf32>
    %1 = stablehlo.dot_general %x, %v, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x32xf32>) -> tensor<8x32xf32>
    %u16 = stablehlo.convert %u : (tensor<16x32xf32>) -> tensor<16x32xbf16>
    return %0, %1, %u16 : tensor<8x32xf32>, tensor<8x32xf32>, tensor<16x32xbf16>
  }
}

// -----

// The program converts %x itself, after the pipeline's convert for the dot: cleanup
// merges the two, and the one left serves the program's readers: it stays as it is.
// CHECK-LABEL: func.func public @main
// CHECK-NOT: sdy.sharding_constraint
// CHECK: return
module @program_convert attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=4, "tp"=2]>
  func.func public @main(%x: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {}]>},
                         %v: tensor<16x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {"tp"}]>})
      -> (tensor<8x32xf32>, tensor<8x16xbf16>) {
    %0 = stablehlo.dot_general %x, %v, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x32xf32>) -> tensor<8x32xf32>
    %x16 = stablehlo.convert %x : (tensor<8x16xf32>) -> tensor<8x16xbf16>
    return %0, %x16 : tensor<8x32xf32>, tensor<8x16xbf16>
  }
}

// -----

// One device: nothing to keep.
// CHECK-LABEL: func.func public @main
// CHECK-NOT: sdy.sharding_constraint
// CHECK: return
module @one_device {
  sdy.mesh @mesh = <["fsdp"=1]>
  func.func public @main(%x: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>},
                         %w: tensor<16x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> tensor<8x32xf32> {
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x32xf32>) -> tensor<8x32xf32>
    return %0 : tensor<8x32xf32>
  }
}
