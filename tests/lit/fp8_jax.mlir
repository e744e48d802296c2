// Real JAX lowerings under the fp8 preset (tests/lit/inputs/make_inputs.py: fp8_mlp_grad,
// fp8_scan_grad).
//
// fp8_mlp_grad: value_and_grad of stem -> attn -> mlp -> head and an SGD update. The
// preset keeps the first (stem) and the last (head) matrix op, and their backward dots,
// in bf16; the rest are fp8 GEMMs, e4m3fn forward, and backward with the incoming
// gradient (the cotangent JAX computes from its seed) in e5m2. The CHECK lines are the
// accurate mode (propagate=false: f32 activations, the dots return f32); FAST is the
// preset's fast mode: the activations between the matrix ops are bf16, as under
// mixed_bfloat16, and fp8 is only at the inputs of the GEMMs, quantised from bf16.
// RUN: hlo-amp-opt %S/inputs/fp8_mlp_grad.mlir --policy 'fp8,propagate=false' --debug-info \
// RUN:   | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %S/inputs/fp8_mlp_grad.mlir --policy fp8 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=FAST
// RUN: hlo-amp-opt %S/inputs/fp8_mlp_grad.mlir --policy fp8 --report %t.json -o /dev/null
// RUN: filecheck %s --input-file %t.json --check-prefix=JSON
//
// Without the first/last rules the stem is fp8 too, and the head (4 outputs) falls back.
// RUN: hlo-amp-opt %S/inputs/fp8_mlp_grad.mlir --policy 'fp8,first_matrix_op=none,last_matrix_op=none' \
// RUN:   --report %t.ends.json -o /dev/null
// RUN: filecheck %s --input-file %t.ends.json --check-prefix=ENDS
//
// fp8_scan_grad: the layers in a scan. The backward dots sit in a private function called
// from the backward while loop; the gradient reaches them as a loop carry and an
// argument, and is still found.
// RUN: hlo-amp-opt %S/inputs/fp8_scan_grad.mlir --policy 'fp8,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=SCAN

// The signature is the program's.
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    -> (tensor<32x32xf32> {jax.result_info = "result[0]['w0']"}, tensor<32x32xf32> {jax.result_info = "result[0]['wa']"}, tensor<32x32xf32> {jax.result_info = "result[0]['wm']"}, tensor<32x4xf32> {jax.result_info = "result[0]['wo']"}, tensor<f32> {jax.result_info = "result[1]"})

// stem (first matrix op): bf16.
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg4 : (tensor<16x32xf32>) -> tensor<16x32xbf16>
// CHECK:         stablehlo.dot_general %[[X16]], %{{.*}} : (tensor<16x32xbf16>, tensor<32x32xbf16>) -> tensor<16x32xf32> loc(#[[STEM:loc[0-9]+]])

// attn, mlp: e4m3fn x e4m3fn.
// CHECK:         %[[A_H:.*]] = stablehlo.convert %{{.*}} : (tensor<16x32xf32>) -> tensor<16x32xf8E4M3FN> loc(#[[ATTN:loc[0-9]+]])
// CHECK:         %[[A_W:.*]] = stablehlo.convert %{{.*}} : (tensor<32x32xf32>) -> tensor<32x32xf8E4M3FN> loc(#[[ATTN]])
// CHECK:         stablehlo.dot_general %[[A_H]], %[[A_W]], contracting_dims = [1] x [0], {{.*}} : (tensor<16x32xf8E4M3FN>, tensor<32x32xf8E4M3FN>) -> tensor<16x32xf32> loc(#[[ATTN]])
// CHECK:         %[[M_H:.*]] = stablehlo.convert %{{.*}} -> tensor<16x32xf8E4M3FN> loc(#[[MLP:loc[0-9]+]])
// CHECK:         %[[M_W:.*]] = stablehlo.convert %{{.*}} -> tensor<32x32xf8E4M3FN> loc(#[[MLP]])
// CHECK:         stablehlo.dot_general %[[M_H]], %[[M_W]], contracting_dims = [1] x [0], {{.*}} -> tensor<16x32xf32> loc(#[[MLP]])

// head (last matrix op) and its two backward dots: bf16.
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<16x32xbf16>, tensor<32x4xbf16>) -> tensor<16x4xf32> loc(#[[HEAD:loc[0-9]+]])
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<16x4xbf16>, tensor<16x32xbf16>) -> tensor<4x32xf32> loc(#[[HEAD_BWD:loc[0-9]+]])
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<16x4xbf16>, tensor<32x4xbf16>) -> tensor<16x32xf32> loc(#[[HEAD_BWD]])

// mlp backward: the cotangent in e5m2, quantised once for dW and dx, which reuse the
// forward's e4m3fn activation and weight.
// CHECK:         stablehlo.constant dense<1.74386169E-5> : tensor<f32> loc(#[[MLP_BWD:loc[0-9]+]])
// CHECK:         %[[G:.*]] = stablehlo.convert %{{.*}} : (tensor<16x32xf32>) -> tensor<16x32xf8E5M2> loc(#[[MLP_BWD]])
// CHECK:         stablehlo.dot_general %[[G]], %[[M_H]], contracting_dims = [0] x [0], {{.*}} -> tensor<32x32xf32> loc(#[[MLP_BWD]])
// CHECK:         stablehlo.dot_general %[[G]], %[[M_W]], contracting_dims = [1] x [1], {{.*}} -> tensor<16x32xf32> loc(#[[MLP_BWD]])

// attn backward: the same.
// CHECK:         %[[GA:.*]] = stablehlo.convert %{{.*}} : (tensor<16x32xf32>) -> tensor<16x32xf8E5M2> loc(#[[ATTN_BWD:loc[0-9]+]])
// CHECK:         stablehlo.dot_general %[[GA]], %[[A_H]], {{.*}} loc(#[[ATTN_BWD]])
// CHECK:         stablehlo.dot_general %[[GA]], %[[A_W]], {{.*}} loc(#[[ATTN_BWD]])

// stem backward (dW only: x is not differentiated): bf16, like its forward dot.
// CHECK-NOT:     xf8E
// CHECK:         stablehlo.dot_general %{{.*}}, %[[X16]], contracting_dims = [0] x [0], {{.*}} : (tensor<16x32xbf16>, tensor<16x32xbf16>) -> tensor<32x32xf32> loc(#[[STEM_BWD:loc[0-9]+]])
// CHECK-NOT:     stablehlo.dot_general
// CHECK:         return

// CHECK-DAG:   #[[STEM]] = loc("jit(fp8_mlp_step)/jvp(stem)/dot_general"
// CHECK-DAG:   #[[ATTN]] = loc("jit(fp8_mlp_step)/jvp(attn)/dot_general"
// CHECK-DAG:   #[[MLP]] = loc("jit(fp8_mlp_step)/jvp(mlp)/dot_general"
// CHECK-DAG:   #[[HEAD]] = loc("jit(fp8_mlp_step)/jvp(head)/dot_general"
// CHECK-DAG:   #[[HEAD_BWD]] = loc("jit(fp8_mlp_step)/transpose(jvp(head))/dot_general"
// CHECK-DAG:   #[[MLP_BWD]] = loc("jit(fp8_mlp_step)/transpose(jvp(mlp))/dot_general"
// CHECK-DAG:   #[[ATTN_BWD]] = loc("jit(fp8_mlp_step)/transpose(jvp(attn))/dot_general"
// CHECK-DAG:   #[[STEM_BWD]] = loc("jit(fp8_mlp_step)/transpose(jvp(stem))/dot_general"

// FAST-LABEL:  func.func public @main
// stem: bf16 operands and a bf16 result, its tanh in bf16.
// FAST:          %[[X16:.*]] = stablehlo.convert %arg4 : (tensor<16x32xf32>) -> tensor<16x32xbf16>
// FAST:          stablehlo.dot_general %[[X16]], %{{.*}} : (tensor<16x32xbf16>, tensor<32x32xbf16>) -> tensor<16x32xbf16>
// FAST:          %[[T0:.*]] = stablehlo.tanh %{{.*}} : tensor<16x32xbf16>
// attn: the bf16 activation quantised to e4m3fn, no barrier (a 16-bit value goes through
// a convert to f32, which XLA's GEMM rewriter does not fuse into the GEMM that made it);
// no f32 copy of an activation between the two dots.
// FAST-NOT:      optimization_barrier
// FAST:          stablehlo.convert %[[T0]] : (tensor<16x32xbf16>) -> tensor<16x32xf32>
// FAST:          %[[A_H:.*]] = stablehlo.convert %{{.*}} : (tensor<16x32xf32>) -> tensor<16x32xf8E4M3FN>
// FAST:          %[[A_W:.*]] = stablehlo.convert %{{.*}} : (tensor<32x32xf32>) -> tensor<32x32xf8E4M3FN>
// FAST:          stablehlo.dot_general %[[A_H]], %[[A_W]], {{.*}} : (tensor<16x32xf8E4M3FN>, tensor<32x32xf8E4M3FN>) -> tensor<16x32xbf16>
// FAST-NOT:      tensor<16x32xf32>
// FAST:          %[[T1:.*]] = stablehlo.tanh %{{.*}} : tensor<16x32xbf16>
// FAST-NOT:      optimization_barrier
// FAST:          stablehlo.convert %[[T1]] : (tensor<16x32xbf16>) -> tensor<16x32xf32>
// FAST:          %[[M_H:.*]] = stablehlo.convert %{{.*}} : (tensor<16x32xf32>) -> tensor<16x32xf8E4M3FN>
// FAST:          %[[M_W:.*]] = stablehlo.convert %{{.*}} : (tensor<32x32xf32>) -> tensor<32x32xf8E4M3FN>
// FAST:          stablehlo.dot_general %[[M_H]], %[[M_W]], {{.*}} -> tensor<16x32xbf16>
// FAST-NOT:      tensor<16x32xf32>
// head: bf16.
// FAST:          stablehlo.dot_general {{.*}} : (tensor<16x32xbf16>, tensor<32x4xbf16>) -> tensor<16x4xbf16>
// mlp backward: the bf16 cotangent quantised to e5m2, no barrier either.
// FAST-NOT:      optimization_barrier
// FAST:          stablehlo.convert %{{.*}} : (tensor<16x32xbf16>) -> tensor<16x32xf32>
// FAST:          %[[G:.*]] = stablehlo.convert %{{.*}} : (tensor<16x32xf32>) -> tensor<16x32xf8E5M2>
// FAST:          stablehlo.dot_general %[[G]], %[[M_H]], contracting_dims = [0] x [0], {{.*}} -> tensor<32x32xbf16>
// FAST:          stablehlo.dot_general %[[G]], %[[M_W]], contracting_dims = [1] x [1], {{.*}} -> tensor<16x32xbf16>
// attn backward: the same.
// FAST:          %[[GA:.*]] = stablehlo.convert %{{.*}} : (tensor<16x32xf32>) -> tensor<16x32xf8E5M2>
// FAST:          stablehlo.dot_general %[[GA]], %[[A_H]], {{.*}} -> tensor<32x32xbf16>
// FAST:          stablehlo.dot_general %[[GA]], %[[A_W]], {{.*}} -> tensor<16x32xbf16>
// stem backward: bf16.
// FAST-NOT:      xf8E
// FAST:          stablehlo.dot_general %{{.*}}, %[[X16]], contracting_dims = [0] x [0], {{.*}} : (tensor<16x32xbf16>, tensor<16x32xbf16>) -> tensor<32x32xbf16>
// FAST:          return

// The report names the positional rules.
// JSON:      "policy": "fp8,compute=bfloat16",
// JSON:      "summary": "converted 11/11 ops; low precision: 11/11 dot_general (6 fp8); {{[0-9]+}}% of FLOPs in 16-bit or narrower
// JSON:      "scope": "stem",
// JSON-NEXT: "direction": "forward",
// JSON:      "action": "compute",
// JSON-NEXT: "rule": "first_matrix_op",
// JSON:      "scope": "attn",
// JSON-NEXT: "direction": "forward",
// JSON:      "action": "float8_e5m2",
// JSON-NEXT: "rule": "op:dot_general",
// JSON:      "scope": "head",
// JSON-NEXT: "direction": "forward",
// JSON:      "rule": "last_matrix_op",
// JSON:      "scope": "head",
// JSON-NEXT: "direction": "backward",
// JSON:      "rule": "last_matrix_op",
// JSON:      "scope": "mlp",
// JSON-NEXT: "direction": "backward",
// JSON:      "reason": "fp8 e5m2 x e4m3fn (lhs is the incoming gradient), per-tensor bf16 scales, bf16 result",
// JSON:      "scope": "stem",
// JSON-NEXT: "direction": "backward",
// JSON:      "rule": "first_matrix_op",
// JSON:      "unused_rules": [],
// JSON:      "fp8: 6 dot_general as fp8 GEMMs (e4m3fn x e4m3fn 2, e5m2 x e4m3fn 4), {{[0-9]+\.[0-9]}}% of FLOPs; 6 tensor(s) quantised with per-tensor current scaling"

// ENDS:      "scope": "stem",
// ENDS:      "rule": "op:dot_general",
// ENDS:      "reason": "fp8 e4m3fn x e4m3fn, per-tensor bf16 scales, bf16 result",
// ENDS:      "scope": "head",
// ENDS:      "reason": "fp8 fallback: n=4 under 16 (cuBLASLt pads fp8 GEMMs to multiples of 16); bf16 operands, f32 accumulation",
// ENDS:      "scope": "stem",
// ENDS-NEXT: "direction": "backward",
// ENDS:      "reason": "fp8 e5m2 x e4m3fn (lhs is the incoming gradient), per-tensor bf16 scales, bf16 result",

// In the preset's fast mode the loop carries and the saved activations are bf16.
// SCAN-LABEL: func.func private @closed_call(
// SCAN-SAME:    %{{.*}}: tensor<16x32xbf16>, %{{.*}}: tensor<32x32xf32>
// SCAN:         stablehlo.dot_general {{.*}} : (tensor<16x32xf8E4M3FN>, tensor<32x32xf8E4M3FN>) -> tensor<16x32xbf16>
// SCAN-LABEL: func.func private @closed_call_1(
// SCAN-SAME:    %{{.*}}: tensor<16x32xbf16>, %{{.*}}: tensor<32x32xf32>, %{{.*}}: tensor<16x32xbf16>
// The saved activation and the weight arrive quantised (hoist_quantize moved their
// quantisations to the backward loop's body: tests/lit/hoist_quantize.mlir).
// SCAN:         %[[G:.*]] = stablehlo.convert %{{.*}} : (tensor<16x32xf32>) -> tensor<16x32xf8E5M2>
// SCAN:         stablehlo.dot_general %[[G]], %{{.*}}, contracting_dims = [0] x [0], {{.*}} : (tensor<16x32xf8E5M2>, tensor<16x32xf8E4M3FN>)
// SCAN:         stablehlo.dot_general %[[G]], %{{.*}}, contracting_dims = [1] x [1], {{.*}} : (tensor<16x32xf8E5M2>, tensor<32x32xf8E4M3FN>)
// SCAN:         return
