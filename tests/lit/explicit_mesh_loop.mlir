// A scan on an Explicit mesh (jax 0.10.2's lowering, trimmed): jax wraps the counter, its
// bound and its increment in sdy.sharding_constraint. The trip count (3) was read as
// unknown there: the report counted the scanned dot once, and fp8's delayed scaling gave
// every layer one history column (layers 1000 times apart: relative error 1.0).
//
// (The trip count is what fp8_state's history columns and the hoist passes read too.)
//
// RUN: hlo-amp-opt %s --policy bf16 --report - -o /dev/null 2>&1 | filecheck %s

// CHECK:      "flops": 196608,
// CHECK:      "runs": 3,
// CHECK-NOT:  trip count of an enclosing while loop unknown

module @jit_f attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["f"=4, "t"=2]>
  func.func public @main(%arg0: tensor<3x32x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg1: tensor<32x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"f"}, {}]>}) -> (tensor<32x32xf32> {jax.result_info = "result", sdy.sharding = #sdy.sharding<@mesh, [{"f"}, {}]>}) {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %0:3 = stablehlo.while(%iterArg = %arg0, %iterArg_0 = %c, %iterArg_1 = %arg1) : tensor<3x32x32xf32>, tensor<i32>, tensor<32x32xf32>
    cond {
      %c_2 = stablehlo.constant dense<3> : tensor<i32>
      %3 = sdy.sharding_constraint %iterArg_0 <@mesh, []> : tensor<i32>
      %4 = sdy.sharding_constraint %c_2 <@mesh, []> : tensor<i32>
      %5 = stablehlo.compare LT, %3, %4, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %5 : tensor<i1>
    } do {
      %c_2 = stablehlo.constant dense<0> : tensor<i32>
      %1 = stablehlo.dynamic_slice %iterArg, %iterArg_0, %c_2, %c_2, sizes = [1, 32, 32] : (tensor<3x32x32xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x32x32xf32>
      %2 = stablehlo.reshape %1 : (tensor<1x32x32xf32>) -> tensor<32x32xf32>
      %3 = stablehlo.dot_general %iterArg_1, %2, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<32x32xf32>, tensor<32x32xf32>) -> tensor<32x32xf32> loc("jit(f)/while/body/dot_general")
      %c_3 = stablehlo.constant dense<1> : tensor<i32>
      %5 = sdy.sharding_constraint %iterArg_0 <@mesh, []> : tensor<i32>
      %6 = sdy.sharding_constraint %c_3 <@mesh, []> : tensor<i32>
      %7 = stablehlo.add %5, %6 : tensor<i32>
      %8 = sdy.sharding_constraint %7 <@mesh, []> : tensor<i32>
      stablehlo.return %iterArg, %8, %3 : tensor<3x32x32xf32>, tensor<i32>, tensor<32x32xf32>
    }
    %9 = sdy.sharding_constraint %0#2 <@mesh, [{"f"}, {}]> : tensor<32x32xf32>
    return %9 : tensor<32x32xf32>
  }
}
