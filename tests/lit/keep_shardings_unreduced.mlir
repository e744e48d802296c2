// A dot's partial sums that jax leaves unreduced (an Explicit mesh's
// out_sharding=P(..., unreduced={"m"})) carry that sharding on the dot itself: with a
// convert (or an fp8 scale) between them, Shardy sums at the dot and the reshard sums
// again. hlo-amp-keep-shardings puts a copy of the unreduced constraint on the operand of
// each such op; the accurate mode leaves the program's convert after the sum.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-keep-shardings \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=ALONE
// RUN: hlo-amp-opt %s --split-input-file --policy bf16 --target cpu \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=BF16
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target cpu \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=MIXED
// Idempotence:
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-keep-shardings \
// RUN:   | hlo-amp-opt --split-input-file --pass hlo-amp-keep-shardings \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=ALONE

// ALONE-LABEL: func.func public @main
// ALONE: %[[D:.*]] = stablehlo.dot_general
// ALONE-NEXT: %[[DU:.*]] = sdy.sharding_constraint %[[D]] <@mesh, [{}, {}], unreduced={"m"}> : tensor<2x2xf32>
// ALONE-NEXT: %[[S:.*]] = stablehlo.multiply %[[DU]], %{{.*}} : tensor<2x2xf32>
// ALONE-NEXT: %[[SU:.*]] = sdy.sharding_constraint %[[S]] <@mesh, [{}, {}], unreduced={"m"}> : tensor<2x2xf32>
// ALONE-NEXT: %[[C:.*]] = stablehlo.convert %[[SU]]
// ALONE-NEXT: sdy.sharding_constraint %[[C]] <@mesh, [{}, {}], unreduced={"m"}> : tensor<2x2xbf16>
// ALONE-NOT: unreduced
// ALONE: return
module @scaled attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["m"=8]>
  func.func public @main(%x: tensor<2x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"m"}]>},
                         %w: tensor<64x2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"m"}, {}]>},
                         %s: tensor<f32>) -> tensor<2x2xbf16> {
    %b = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<2x2xf32>
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x64xf32>, tensor<64x2xf32>) -> tensor<2x2xf32>
    %1 = stablehlo.multiply %0, %b : tensor<2x2xf32>
    %2 = stablehlo.convert %1 : (tensor<2x2xf32>) -> tensor<2x2xbf16>
    %3 = sdy.sharding_constraint %2 <@mesh, [{}, {}], unreduced={"m"}> : tensor<2x2xbf16>
    %4 = sdy.sharding_constraint %3 <@mesh, [{}, {}]> : tensor<2x2xbf16>
    return %4 : tensor<2x2xbf16>
  }
}

// -----

// jax's own form: the dot's result constrained, summed, then converted.
// BF16-LABEL: module @jax_form
// BF16: %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x2xf32>
// BF16-NEXT: %[[DU:.*]] = sdy.sharding_constraint %[[D]] <@mesh, [{}, {}], unreduced={"m"}> : tensor<2x2xf32>
// BF16-NEXT: %[[SUM:.*]] = sdy.sharding_constraint %[[DU]] <@mesh, [{}, {}]> : tensor<2x2xf32>
// BF16-NEXT: stablehlo.convert %[[SUM]] : (tensor<2x2xf32>) -> tensor<2x2xbf16>
// MIXED-LABEL: module @jax_form
// MIXED: %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x2xf32>
// MIXED-NEXT: %[[DU:.*]] = sdy.sharding_constraint %[[D]] <@mesh, [{}, {}], unreduced={"m"}> : tensor<2x2xf32>
// MIXED-NEXT: %[[C:.*]] = stablehlo.convert %[[DU]] : (tensor<2x2xf32>) -> tensor<2x2xbf16>
// MIXED-NEXT: sdy.sharding_constraint %[[C]] <@mesh, [{}, {}], unreduced={"m"}> : tensor<2x2xbf16>
module @jax_form attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["m"=8]>
  func.func public @main(%x: tensor<2x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"m"}]>},
                         %w: tensor<64x2xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"m"}, {}]>}) -> tensor<2x2xbf16> {
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x64xf32>, tensor<64x2xf32>) -> tensor<2x2xf32>
    %1 = sdy.sharding_constraint %0 <@mesh, [{}, {}], unreduced={"m"}> : tensor<2x2xf32>
    %2 = sdy.sharding_constraint %1 <@mesh, [{}, {}]> : tensor<2x2xf32>
    %3 = stablehlo.convert %2 : (tensor<2x2xf32>) -> tensor<2x2xbf16>
    return %3 : tensor<2x2xbf16>
  }
}
