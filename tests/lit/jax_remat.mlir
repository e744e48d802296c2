// A real JAX lowering (tests/lit/inputs/make_inputs.py: remat): grad w.r.t. w of a
// jax.checkpoint block under scope Block_0 (inner scope mlp), then a head. The
// rematerialised forward dot is named
// "transpose(jvp(Block_0))/jvp(Block_0)/checkpoint/rematted_computation/mlp/dot_general":
// its scope is Block_0/mlp, like the first forward dot.
//
// RUN: hlo-amp-opt %S/inputs/remat.mlir --policy bf16 | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %S/inputs/remat.mlir --policy 'bf16,scope:Block_0/mlp=keep' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=KEEP
// RUN: hlo-amp-opt %S/inputs/remat.mlir --policy 'bf16,scope:Block_0/mlp=keep' --report - \
// RUN:   -o /dev/null 2>&1 | filecheck %s --check-prefix=JSON

// Everything computes in bf16; the optimization_barrier remat puts in stays.
// CHECK-LABEL: func.func public @main
// CHECK-COUNT-3: stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<{{2x4|4x4}}xbf16>)
// CHECK:         stablehlo.optimization_barrier
// CHECK-COUNT-2: stablehlo.dot_general {{.*}} : (tensor<{{2x4|4x4}}xbf16>, tensor<{{2x4|4x4}}xbf16>)
// CHECK-NOT:     stablehlo.dot_general
// CHECK:         return

// Block_0/mlp kept everywhere (first forward, rematerialised forward, backward);
// the head's two backward dots still compute in bf16.
// KEEP-LABEL: func.func public @main
// KEEP:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>)
// KEEP-COUNT-2: stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<{{2x4|4x4}}xbf16>)
// KEEP:         stablehlo.optimization_barrier
// KEEP-NOT:     xbf16>
// KEEP:         return

// JSON:      "scope": "Block_0/mlp",
// JSON-NEXT: "direction": "forward",
// JSON:      "rule": "scope:Block_0/mlp",
// JSON:      "scope": "head",
// JSON:      "scope": "head",
// The rematerialised forward is reported as "recomputed", the gradient dot as "backward".
// JSON:      "scope": "Block_0/mlp",
// JSON-NEXT: "direction": "recomputed",
// JSON:      "rule": "scope:Block_0/mlp",
// JSON:      "location": "jit(remat_loss)/transpose(jvp(Block_0))/jvp(Block_0)/checkpoint/rematted_computation/mlp/dot_general",
// JSON:      "scope": "Block_0/mlp",
// JSON-NEXT: "direction": "backward",
// JSON:      "rule": "scope:Block_0/mlp",
// JSON:      "unused_rules": [],
