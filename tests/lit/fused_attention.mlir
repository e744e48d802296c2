// A real JAX lowering (tests/lit/inputs/make_inputs.py: attention_grad): the gradient of
// jax.nn.dot_product_attention (causal, 4 query heads over 2 key/value heads, scope attn)
// with respect to q, k and v. On a GPU target its forward and backward become cuDNN's
// fused attention, the calls jax.nn.dot_product_attention(implementation="cudnn") makes,
// with q, k, v and dO converted to bf16 and the results back to f32: no score matrix, no
// exponential, no dot_general is left (passes/fused_attention/). On CPU, or where a
// scope rule keeps the attention f32, it stays as written, and the report says why.
//
// RUN: hlo-amp-opt %S/inputs/attention_grad.mlir --pass hlo-amp-fused-attention \
// RUN:   --policy bf16 --target gpu | filecheck %s --check-prefix=FUSED
// RUN: hlo-amp-opt %S/inputs/attention_grad.mlir --pass hlo-amp-fused-attention \
// RUN:   --policy bf16 --target cpu | filecheck %s --check-prefix=KEPT
// RUN: hlo-amp-opt %S/inputs/attention_grad.mlir --pass hlo-amp-fused-attention \
// RUN:   --policy 'bf16,scope:attn=float32' --target gpu | filecheck %s --check-prefix=KEPT
// RUN: hlo-amp-opt %S/inputs/attention_grad.mlir --policy mixed_bfloat16 --target gpu \
// RUN:   --report - -o /dev/null 2>&1 | filecheck %s --check-prefix=REPORT
// RUN: hlo-amp-opt %S/inputs/attention_grad.mlir --policy bf16 --target cpu --report - \
// RUN:   -o /dev/null 2>&1 | filecheck %s --check-prefix=WHY
// Under fp8 an attention left unfused keeps its six matmuls (two forward, four backward)
// in the 16-bit compute type, as the fused kernel runs them; a scope rule asks for fp8.
// RUN: hlo-amp-opt %S/inputs/attention_grad.mlir --target cpu --report - -o /dev/null \
// RUN:   --policy 'fp8,first_matrix_op=none,last_matrix_op=none' 2>&1 \
// RUN:   | filecheck %s --check-prefix=FP8
// RUN: hlo-amp-opt %S/inputs/attention_grad.mlir --target cpu --report - -o /dev/null \
// RUN:   --policy 'fp8,first_matrix_op=none,last_matrix_op=none,scope:attn=float8_e5m2' \
// RUN:   2>&1 | filecheck %s --check-prefix=FP8SCOPE
// The mark the fused-attention pass leaves on those matmuls does not reach the output.
// RUN: hlo-amp-opt %S/inputs/attention_grad.mlir --target cpu \
// RUN:   --policy 'fp8,first_matrix_op=none,last_matrix_op=none' | filecheck %s --check-prefix=NOMARK

// FUSED-LABEL: func.func public @main
// FUSED-NOT:     stablehlo.dot_general
// FUSED-DAG:     %[[Q:.*]] = stablehlo.convert %{{.*}} : (tensor<2x8x4x8xf32>) -> tensor<2x8x4x8xbf16>
// FUSED-DAG:     %[[K:.*]] = stablehlo.convert %arg1 : (tensor<2x8x2x8xf32>) -> tensor<2x8x2x8xbf16>
// FUSED-DAG:     %[[V:.*]] = stablehlo.convert %arg2 : (tensor<2x8x2x8xf32>) -> tensor<2x8x2x8xbf16>
// FUSED:         %[[FWD:.*]]:3 = stablehlo.custom_call @__cudnn$fmhaSoftmax(%[[Q]], %[[K]], %[[V]])
// FUSED-SAME:    \22mask_type\22: \22CAUSAL\22
// FUSED-NOT:     stablehlo.exponential
// FUSED:         %[[DO:.*]] = stablehlo.convert %{{.*}} : (tensor<2x8x4x8xf32>) -> tensor<2x8x4x8xbf16>
// FUSED:         stablehlo.custom_call @__cudnn$fmhaSoftmaxBackward(%[[Q]], %[[K]], %[[V]], %[[FWD]]#1, %[[DO]],
// FUSED-NOT:     stablehlo.dot_general
// FUSED-NOT:     stablehlo.exponential
// FUSED:         return

// KEPT-LABEL: func.func public @main
// KEPT-NOT:    custom_call
// KEPT-COUNT-6: stablehlo.dot_general
// KEPT-NOT:    custom_call

// REPORT: "summary": "{{.*}}attention: 1 of 1 sites fused (cuDNN flash)
// REPORT: "attention": [
// REPORT:   "scope": "attn",
// REPORT:   "direction": "forward and backward",
// REPORT:   "fused": true,
// REPORT:   "shapes": "q 2x8x4x8, k/v 2x8x2x8 (BTNH)",
// REPORT:   "mask": "causal",

// WHY: "summary": "{{.*}}attention: 0 of 1 sites fused
// WHY: "attention": [
// WHY:   "fused": false,
// WHY:   "reason": "CPU: cuDNN's fused attention is a GPU kernel",

// FP8-COUNT-6: "reason": "fp8 fallback: an attention's matmul, not fused (the report's attention section says why): 16-bit as the fused kernel runs it; a scope rule can ask for fp8; bf16 operands, f32 accumulation",
// FP8-NOT:     "reason": "fp8 {{e4m3fn|e5m2}}
// FP8:         "attention": [
// FP8:           "fused": false,

// FP8SCOPE-NOT: an attention's matmul
// FP8SCOPE:     "rule": "scope:attn",
// FP8SCOPE-NOT: an attention's matmul

// NOMARK-LABEL: func.func public @main
// NOMARK-NOT:   hlo_amp.attention
// NOMARK:       return
