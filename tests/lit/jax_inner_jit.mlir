// A real JAX lowering (tests/lit/inputs/make_inputs.py: inner_jit): a jitted function
// lowers to one private func.func @inner, called under "enc" and under "head". With
// head=keep the two calls need different decisions, so @inner is specialised.
//
// RUN: hlo-amp-opt %S/inputs/inner_jit.mlir --policy 'bf16,scope:head=keep' | filecheck %s --enable-var-scope
// Idempotence, on located output.
// RUN: hlo-amp-opt %S/inputs/inner_jit.mlir --policy 'bf16,scope:head=keep' --debug-info \
// RUN:   | hlo-amp-opt --policy 'bf16,scope:head=keep' | filecheck %s --enable-var-scope
// Decided alike from both scopes: still a body per scope, each call's op reported under
// its own scope.
// RUN: hlo-amp-opt %S/inputs/inner_jit.mlir --policy bf16 | filecheck %s --check-prefix=SAME
// RUN: hlo-amp-opt %S/inputs/inner_jit.mlir --policy 'bf16,scope:head=keep' --report - \
// RUN:   -o /dev/null 2>&1 | filecheck %s --check-prefix=JSON

// CHECK-LABEL: func.func public @main
// CHECK:         %[[A:.*]] = call @inner(%arg0, %arg1)
// CHECK:         %[[B:.*]] = call @inner_amp0(%[[A]], %arg1)
// CHECK:         return %[[B]]
// CHECK-LABEL: func.func private @inner(
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg0 : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[W16:.*]] = stablehlo.convert %arg1 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         stablehlo.dot_general %[[X16]], %[[W16]], {{.*}} -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @inner_amp0(
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
// CHECK-NOT:     func.func

// SAME-LABEL: func.func public @main
// SAME:         call @inner(
// SAME:         call @inner_amp0(
// SAME:         func.func private @inner(
// SAME:         stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>)
// SAME:         func.func private @inner_amp0(
// SAME:         stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>)
// SAME-NOT:     func.func

// JSON:      "function": "inner",
// JSON-NEXT: "op_kind": "dot_general",
// JSON-NEXT: "scope": "enc",
// JSON:      "changed": true,
// JSON:      "location": "jit(outer)/enc/dot_general",
// JSON:      "function": "inner_amp0",
// JSON-NEXT: "op_kind": "dot_general",
// JSON-NEXT: "scope": "head",
// JSON:      "rule": "scope:head",
// JSON-NEXT: "changed": false,
// JSON:      "location": "jit(outer)/head/dot_general",
// JSON:      "unused_rules": [],
// JSON-NEXT: "notes": [
// JSON-NEXT:   "specialised 1 private function(s) per call-site decision"
