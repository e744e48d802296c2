// A real JAX lowering (tests/lit/inputs/make_inputs.py: cond): lax.cond lowers to
// stablehlo.case; each branch's ops are named "cond/branch_N_fun/...". Branch 0 runs
// under a user scope named "body" (not the "while/body" JAX writes), branch 1 under "head".
//
// RUN: hlo-amp-opt %S/inputs/cond.mlir --policy 'bf16,scope:head=keep' | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %S/inputs/cond.mlir --policy 'bf16,scope:body=keep' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=BODY

// CHECK-LABEL: func.func public @main
// CHECK:         "stablehlo.case"
// The weight's convert goes before the transpose JAX writes (hlo-amp-comm-precision).
// CHECK:           %[[W16:.*]] = stablehlo.convert %arg2 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:           %[[WT:.*]] = stablehlo.transpose %[[W16]], dims = [1, 0] : (tensor<4x4xbf16>) -> tensor<4x4xbf16>
// CHECK:           %[[X16:.*]] = stablehlo.convert %{{.*}} : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:           %[[D:.*]] = stablehlo.dot_general %[[X16]], %[[WT]], {{.*}} -> tensor<2x4xf32>
// CHECK:           stablehlo.return %[[D]]
// CHECK:         }, {
// CHECK-NOT:       stablehlo.convert
// CHECK:           stablehlo.dot_general %arg1, %arg2, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>

// BODY-LABEL: func.func public @main
// BODY:         "stablehlo.case"
// BODY-NOT:       stablehlo.convert
// BODY:           stablehlo.dot_general {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
// BODY:         }, {
// BODY:           %[[X16:.*]] = stablehlo.convert %arg1 : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// BODY:           %[[W16:.*]] = stablehlo.convert %arg2 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// BODY:           stablehlo.dot_general %[[X16]], %[[W16]], {{.*}} -> tensor<2x4xf32>
