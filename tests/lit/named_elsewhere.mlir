// A private function that a func.call calls and a composite decomposes into (or a
// custom call runs) keeps its signature in the fast mode: the call is a boundary, as a
// public callee's. Retyped for the call site, @g returned bf16 while the composite's
// types stayed f32 (an invalid module: "decomposition has type 'tensor<4x8xbf16>'"),
// and a custom call's @h silently changed signature (until 2026-11-30).
//
// RUN: hlo-amp-opt %s --policy mixed_bfloat16 --split-input-file --verify-each | filecheck %s
// RUN: hlo-amp-opt %s --policy mixed_float16 --split-input-file --verify-each | filecheck %s

// CHECK-LABEL: module @composite
// CHECK: stablehlo.composite "my.g" {{.*}} : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
// CHECK: call @g({{.*}}) : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
// CHECK: func.func private @g(%{{.*}}: tensor<4x8xf32>, %{{.*}}: tensor<8x8xf32>) -> tensor<4x8xf32>
module @composite {
  func.func public @main(%a: tensor<4x8xf32>, %b: tensor<8x8xf32>) -> tensor<4x8xf32> {
    %0 = stablehlo.composite "my.g" %a, %b {decomposition = @g} : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %1 = stablehlo.dot_general %0, %b, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %2 = call @g(%1, %b) : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %3 = stablehlo.dot_general %2, %b, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    return %3 : tensor<4x8xf32>
  }
  func.func private @g(%a: tensor<4x8xf32>, %b: tensor<8x8xf32>) -> tensor<4x8xf32> {
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %1 = stablehlo.tanh %0 : tensor<4x8xf32>
    return %1 : tensor<4x8xf32>
  }
}

// -----

// CHECK-LABEL: module @custom_call
// CHECK: stablehlo.custom_call @my_kernel({{.*}}called_computations = [@h]{{.*}} -> tensor<4x8xf32>
// CHECK: func.func private @h(%{{.*}}: tensor<4x8xf32>, %{{.*}}: tensor<8x8xf32>) -> tensor<4x8xf32>
module @custom_call {
  func.func public @main(%a: tensor<4x8xf32>, %b: tensor<8x8xf32>) -> tensor<4x8xf32> {
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %1 = stablehlo.custom_call @my_kernel(%0, %b) {called_computations = [@h], api_version = 2 : i32} : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %2 = call @h(%1, %b) : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %3 = stablehlo.dot_general %2, %b, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    return %3 : tensor<4x8xf32>
  }
  func.func private @h(%a: tensor<4x8xf32>, %b: tensor<8x8xf32>) -> tensor<4x8xf32> {
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %1 = stablehlo.tanh %0 : tensor<4x8xf32>
    return %1 : tensor<4x8xf32>
  }
}
