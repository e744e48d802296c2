// A real JAX lowering (tests/lit/inputs/make_inputs.py: flax_linen): grad of a Flax
// Linen module LBlk with nn.Dense(name="fc1") and nn.Dense(name="fc2"). Linen writes
// module paths into the name stack, so "LBlk/fc2" addresses one layer.
//
// RUN: hlo-amp-opt %S/inputs/flax_linen.mlir --policy 'bf16,scope:LBlk/fc2=keep' --debug-info \
// RUN:   | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %S/inputs/flax_linen.mlir --policy 'bf16,scope:LBlk/fc2=keep' \
// RUN:   --report - -o /dev/null 2>&1 | filecheck %s --check-prefix=JSON

// CHECK-LABEL: func.func public @main
// fc1 forward: x (%arg3) and the fc1 kernel (%arg1) in bf16.
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg3 : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[K16:.*]] = stablehlo.convert %arg1 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         stablehlo.dot_general %[[X16]], %[[K16]], {{.*}} -> tensor<2x4xf32> loc(#[[FC1:loc[0-9]+]])
// fc2 backward (dW and dx): kept in f32 by the LBlk/fc2 rule.
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<2x3xf32>, tensor<2x4xf32>) -> tensor<3x4xf32> loc(#[[FC2_BWD:loc[0-9]+]])
// CHECK:         stablehlo.dot_general {{.*}}, %arg2, {{.*}} : (tensor<2x3xf32>, tensor<4x3xf32>) -> tensor<2x4xf32> loc(#[[FC2_BWD]])
// fc1 backward dW: the cotangent in bf16, x's convert shared with the forward.
// CHECK:         %[[G16:.*]] = stablehlo.convert %{{.*}} : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[G16]], %[[X16]], {{.*}} -> tensor<4x4xf32> loc(#[[FC1_BWD:loc[0-9]+]])
// CHECK:         return
// CHECK-DAG:   #[[FC1]] = loc("jit(loss)/jvp(LBlk)/fc1/dot_general"
// CHECK-DAG:   #[[FC2_BWD]] = loc("jit(loss)/transpose(jvp(LBlk))/fc2/dot_general"
// CHECK-DAG:   #[[FC1_BWD]] = loc("jit(loss)/transpose(jvp(LBlk))/fc1/dot_general"

// JSON:      "summary": "converted 2/4 ops;
// JSON:      "scope": "LBlk/fc1",
// JSON-NEXT: "direction": "forward",
// JSON:      "changed": true,
// JSON:      "scope": "LBlk/fc2",
// JSON-NEXT: "direction": "backward",
// JSON:      "action": "keep",
// JSON-NEXT: "rule": "scope:LBlk/fc2",
// JSON-NEXT: "changed": false,
// JSON:      "scope": "LBlk/fc2",
// JSON:      "scope": "LBlk/fc1",
// JSON-NEXT: "direction": "backward",
// JSON:      "rule": "op:dot_general",
// JSON-NEXT: "changed": true,
