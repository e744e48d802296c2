// A real JAX lowering (tests/lit/inputs/make_inputs.py: scan_rnn): grad of a lax.scan
// RNN. The cell's dot sits in private functions called from stablehlo.while bodies:
// @closed_call (forward, "jvp()/while/body/closed_call") and @closed_call_0 (backward,
// "transpose(jvp())/while/body/closed_call"). The ops inside carry names relative to
// the function ("cell/dot_general"); the call site supplies the rest.
//
// RUN: hlo-amp-opt %S/inputs/scan_rnn.mlir --policy bf16 | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %S/inputs/scan_rnn.mlir --policy 'bf16,backward=keep' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=BWD
// RUN: hlo-amp-opt %S/inputs/scan_rnn.mlir --policy 'bf16,scope:cell=keep' \
// RUN:   | filecheck %s --check-prefix=KEEP
// RUN: hlo-amp-opt %S/inputs/scan_rnn.mlir --policy bf16 --report - -o /dev/null 2>&1 \
// RUN:   | filecheck %s --check-prefix=JSON
// RUN: hlo-amp-opt %S/inputs/scan_rnn.mlir --policy bf16 --report - -o /dev/null 2>&1 \
// RUN:   | filecheck %s --check-prefix=RUNS
// RUN: hlo-amp-opt %S/inputs/nested_scan.mlir --policy bf16 --report - -o /dev/null 2>&1 \
// RUN:   | filecheck %s --check-prefix=NESTED

// The weights are a carry both loops return unchanged: their bf16 convert is computed
// once, before the first loop, and carried by both (a new last carry); neither body
// converts them, and the callees take the bf16 weights. The signature is untouched.
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    (%arg0: tensor<4x4xf32>, %arg1: tensor<3x2x4xf32>) -> (tensor<4x4xf32> {jax.result_info = "result"})
// CHECK:         %[[W16:.*]] = stablehlo.convert %arg0 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.while({{.*}}, %[[FW16:.*]] = %[[W16]]) : tensor<3x2x4xf32>, tensor<4x4xf32>, tensor<i32>, tensor<2x4xf32>, tensor<3x2x4xf32>, tensor<3x2x4xf32>, tensor<3x2x4xf32>, tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         func.call @closed_call(%[[FW16]], {{.*}}) : (tensor<4x4xbf16>, tensor<2x4xf32>, tensor<2x4xf32>) ->
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.return {{.*}}, %[[FW16]] : {{.*}}, tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.while({{.*}}, %[[BW16:.*]] = %[[W16]]) : tensor<3x2x4xf32>, tensor<3x2x4xf32>, tensor<3x2x4xf32>, tensor<4x4xf32>, tensor<i32>, tensor<4x4xf32>, tensor<2x4xf32>, tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         func.call @closed_call_0(%[[BW16]], {{.*}}) : (tensor<4x4xbf16>, tensor<4x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>) ->
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.return {{.*}}, %[[BW16]] : {{.*}}, tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         return
// CHECK-LABEL: func.func private @closed_call(
// CHECK-SAME:    %[[W:.*]]: tensor<4x4xbf16>, %[[H:.*]]: tensor<2x4xf32>, %{{.*}}: tensor<2x4xf32>)
// CHECK:         %[[H16:.*]] = stablehlo.convert %[[H]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %[[H16]], %[[W]], {{.*}} -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @closed_call_0(
// CHECK-SAME:    %[[W:[^:]*]]: tensor<4x4xbf16>
// CHECK:         %[[G16:.*]] = stablehlo.convert %{{.*}} : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg3 : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[G16]], %[[X16]], {{.*}} -> tensor<4x4xf32>
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %[[G16]], %[[W]], {{.*}} -> tensor<2x4xf32>

// BWD-LABEL: func.func private @closed_call(
// BWD:         stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>)
// BWD-LABEL: func.func private @closed_call_0(
// BWD-NOT:     stablehlo.convert
// BWD:         return

// KEEP-NOT: stablehlo.convert {{.*}}bf16

// JSON:      "function": "closed_call",
// JSON-NEXT: "op_kind": "dot_general",
// JSON-NEXT: "scope": "cell",
// JSON-NEXT: "direction": "forward",
// JSON:      "location": "jit(rnn_loss)/jvp()/while/body/cell/dot_general",
// JSON:      "function": "closed_call_0",
// JSON-NEXT: "op_kind": "dot_general",
// JSON-NEXT: "scope": "cell",
// JSON-NEXT: "direction": "backward",
// JSON:      "location": "jit(rnn_loss)/transpose(jvp())/while/body/cell/dot_general",
// JSON:      "function": "closed_call_0",
// JSON-NEXT: "op_kind": "dot_general",
// JSON-NEXT: "scope": "cell",
// JSON-NEXT: "direction": "backward",

// Each cell dot runs once per step of its 3-step loop: its FLOPs (2 x 2x4 x 4 = 64 a
// run) count all three runs.
// RUNS:      "flops": 192,
// RUNS-NEXT: "shape": "2x4",
// RUNS-NEXT: "runs": 3,
// RUNS-NEXT: "location": "jit(rnn_loss)/jvp()/while/body/cell/dot_general",
// RUNS:      "flops": 192,
// RUNS-NEXT: "shape": "4x4",
// RUNS-NEXT: "runs": 3,
// RUNS-NEXT: "location": "jit(rnn_loss)/transpose(jvp())/while/body/cell/dot_general",

// A scan of 2 steps around a scan of 3: the inner body's dot runs 6 times.
// NESTED:      "flops": 384,
// NESTED-NEXT: "shape": "2x4",
// NESTED-NEXT: "runs": 6,
