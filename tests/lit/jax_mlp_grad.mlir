// A real JAX lowering (tests/lit/inputs/make_inputs.py: mlp_train_step): value_and_grad
// of an MLP with scopes Block_0/attn, Block_0/mlp, an amp_stop region and a head.
// --debug-info keeps the input's name-stack locations, so each check ties an op to
// the scope it came from.
//
// RUN: hlo-amp-opt %S/inputs/mlp_grad.mlir --policy 'bf16,scope:head=float32' --debug-info \
// RUN:   | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %S/inputs/mlp_grad.mlir --policy 'bf16,backward=keep' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=BWD
// RUN: hlo-amp-opt %S/inputs/mlp_grad.mlir --policy 'bf16,scope:head=float32' \
// RUN:   --report %t.json -o /dev/null
// RUN: filecheck %s --input-file %t.json --check-prefix=JSON

// The signature is the program's: f32 parameters in, f32 parameters and loss out.
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    -> (tensor<4x4xf32> {jax.result_info = "result[0]['w1']"}, tensor<4x4xf32> {jax.result_info = "result[0]['wg']"}, tensor<4x3xf32> {jax.result_info = "result[0]['wo']"}, tensor<4x4xf32> {jax.result_info = "result[0]['wq']"}, tensor<f32> {jax.result_info = "result[1]"})

// Forward Block_0/attn: x (%arg4) and wq (%arg3) to bf16, f32 result.
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg4 : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[WQ16:.*]] = stablehlo.convert %arg3 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         stablehlo.dot_general %[[X16]], %[[WQ16]], {{.*}} -> tensor<2x4xf32> loc(#[[ATTN:loc[0-9]+]])

// Forward Block_0/mlp: the activation and w1 (%arg0).
// CHECK:         %[[H16:.*]] = stablehlo.convert %{{.*}} : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[W116:.*]] = stablehlo.convert %arg0 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         stablehlo.dot_general %[[H16]], %[[W116]], {{.*}} -> tensor<2x4xf32> loc(#[[MLP:loc[0-9]+]])

// Forward amp_stop (wg, %arg1) and head (wo, %arg2): f32 as written.
// CHECK:         stablehlo.dot_general %{{.*}}, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc(#[[STOP:loc[0-9]+]])
// CHECK:         stablehlo.dot_general %{{.*}}, %arg2, {{.*}} : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc(#[[HEAD:loc[0-9]+]])

// Backward head (dW, dx) and amp_stop (dW, dx): f32.
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<2x3xf32>, tensor<2x4xf32>) -> tensor<3x4xf32> loc(#[[HEAD_BWD:loc[0-9]+]])
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<2x3xf32>, tensor<4x3xf32>) -> tensor<2x4xf32> loc(#[[HEAD_BWD]])
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<4x4xf32> loc(#[[STOP_BWD:loc[0-9]+]])
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc(#[[STOP_BWD]])

// Backward Block_0/mlp: the cotangent is converted; the forward's converts are shared.
// CHECK:         %[[G16:.*]] = stablehlo.convert %{{.*}} : (tensor<2x4xf32>) -> tensor<2x4xbf16> loc(#[[MLP_BWD:loc[0-9]+]])
// CHECK:         stablehlo.dot_general %[[G16]], %[[H16]], {{.*}} -> tensor<4x4xf32> loc(#[[MLP_BWD]])
// CHECK:         stablehlo.dot_general %[[G16]], %[[W116]], {{.*}} -> tensor<2x4xf32> loc(#[[MLP_BWD]])

// Backward Block_0/attn: only dW (x is not differentiated); x's convert is shared.
// CHECK:         %[[GA16:.*]] = stablehlo.convert %{{.*}} : (tensor<2x4xf32>) -> tensor<2x4xbf16> loc(#[[ATTN_BWD:loc[0-9]+]])
// CHECK:         stablehlo.dot_general %[[GA16]], %[[X16]], {{.*}} -> tensor<4x4xf32> loc(#[[ATTN_BWD]])
// CHECK-NOT:     stablehlo.dot_general
// CHECK:         return

// CHECK-DAG:   #[[ATTN]] = loc("jit(mlp_train_step)/jvp(Block_0)/attn/dot_general"
// CHECK-DAG:   #[[MLP]] = loc("jit(mlp_train_step)/jvp(Block_0)/mlp/dot_general"
// CHECK-DAG:   #[[STOP]] = loc("jit(mlp_train_step)/jvp(Block_0)/amp_stop/dot_general"
// CHECK-DAG:   #[[HEAD]] = loc("jit(mlp_train_step)/jvp(head)/dot_general"
// CHECK-DAG:   #[[HEAD_BWD]] = loc("jit(mlp_train_step)/transpose(jvp(head))/dot_general"
// CHECK-DAG:   #[[STOP_BWD]] = loc("jit(mlp_train_step)/transpose(jvp(Block_0))/amp_stop/dot_general"
// CHECK-DAG:   #[[MLP_BWD]] = loc("jit(mlp_train_step)/transpose(jvp(Block_0))/mlp/dot_general"
// CHECK-DAG:   #[[ATTN_BWD]] = loc("jit(mlp_train_step)/transpose(jvp(Block_0))/attn/dot_general"

// backward=keep: the forward attn, mlp and head dots compute in bf16; no backward does.
// BWD-LABEL:   func.func public @main
// BWD-COUNT-3: stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<{{4x4|4x3}}xbf16>)
// BWD-NOT:     xbf16>
// BWD:         return

// JSON:      "summary": "converted 5/11 ops; low precision: 5/11 dot_general; {{[0-9]+}}% of FLOPs in 16-bit or narrower",
// JSON:      "scope": "Block_0/attn",
// JSON-NEXT: "direction": "forward",
// JSON:      "rule": "op:dot_general",
// JSON-NEXT: "changed": true,
// JSON:      "source": "make_inputs.py:{{[0-9]+}}",
// JSON:      "scope": "Block_0/amp_stop",
// JSON-NEXT: "direction": "forward",
// JSON:      "rule": "amp_stop",
// JSON-NEXT: "changed": false,
// JSON:      "scope": "head",
// JSON-NEXT: "direction": "forward",
// JSON:      "action": "float32",
// JSON-NEXT: "rule": "scope:head",
// JSON-NEXT: "changed": false,
// JSON-NEXT: "reason": "already float32",
// JSON:      "scope": "head",
// JSON-NEXT: "direction": "backward",
// JSON:      "rule": "scope:head",
// JSON:      "scope": "Block_0/attn",
// JSON-NEXT: "direction": "backward",
// JSON:      "rule": "op:dot_general",
// JSON-NEXT: "changed": true,
// JSON:      "unused_rules": [],
