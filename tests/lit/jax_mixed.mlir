// The mixed_bfloat16 pipeline on real JAX lowerings (tests/lit/inputs/make_inputs.py).
//
// RUN: hlo-amp-opt %S/inputs/scan_rnn.mlir --policy mixed_bfloat16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=RNN
// RUN: hlo-amp-opt %S/inputs/conv_net.mlir --policy mixed_bfloat16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=CONV
// RUN: hlo-amp-opt %S/inputs/remat.mlir --policy mixed_bfloat16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=REMAT
// RUN: hlo-amp-opt %S/inputs/transformer_block.mlir --policy mixed_bfloat16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=BLOCK
// RUN: hlo-amp-opt %S/inputs/scan_rnn.mlir --policy mixed_bfloat16 --report - -o /dev/null 2>&1 \
// RUN:   | filecheck %s --check-prefix=JSON

// grad of a lax.scan recurrent net, `tanh(h @ W + x_t)`: the raw per-step input x_t is
// f32 data, which the step adds to the 16-bit matrix result, so the add, the tanh, the
// hidden-state carry and the stacked residuals stay f32, as JAX's promotion keeps a hand
// cast's (a net with an input projection, `x_t @ U`, has them 16-bit). The weights (a
// loop-invariant carry no 16-bit op produces) stay f32, and their bf16 copy for the dots
// is converted once, before the loops, and carried as a new last carry; the public
// signature is unchanged.
// RNN-LABEL: func.func public @main
// RNN-SAME:    (%arg0: tensor<4x4xf32>, %arg1: tensor<3x2x4xf32>) -> (tensor<4x4xf32> {jax.result_info = "result"})
// RNN:         %[[W16:.*]] = stablehlo.convert %arg0 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// RNN:         stablehlo.while({{.*}}, %[[FW16:.*]] = %[[W16]]) : tensor<3x2x4xf32>, tensor<4x4xf32>, tensor<i32>, tensor<2x4xf32>, tensor<3x2x4xf32>, tensor<3x2x4xf32>, tensor<3x2x4xf32>, tensor<4x4xbf16>
// RNN-NOT:     stablehlo.convert %{{.*}} : (tensor<4x4xf32>)
// RNN:         func.call @closed_call(%[[FW16]], {{.*}}) : (tensor<4x4xbf16>, tensor<2x4xf32>, tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>)
// RNN:         return %{{.*}} : tensor<4x4xf32>
// RNN-LABEL: func.func private @closed_call(
// RNN:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// RNN:         %[[D32:.*]] = stablehlo.convert %[[D]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// RNN:         %[[A:.*]] = stablehlo.add %[[D32]], %arg2 : tensor<2x4xf32>
// RNN:         stablehlo.tanh %[[A]] : tensor<2x4xf32>

// grad of conv -> tanh -> dense: the conv, tanh and the reshape into the dense layer
// are one bf16 region; the dense layer's weight-gradient dot returns bf16 (as
// TensorFlow's and PyTorch's AMP write it) and is converted up for the transpose into
// the f32 gradient output; the backward data path (dot, reshape, tanh') is bf16. The
// filter-gradient convolution, returned as it is, keeps its f32 result.
// CONV-LABEL: func.func public @main
// CONV:         %[[C:.*]] = stablehlo.convolution({{.*}}) {{.*}} -> tensor<1x4x4x3xbf16>
// CONV:         %[[T:.*]] = stablehlo.tanh %[[C]] : tensor<1x4x4x3xbf16>
// CONV:         %[[R:.*]] = stablehlo.reshape %[[T]] : (tensor<1x4x4x3xbf16>) -> tensor<1x48xbf16>
// CONV:         %[[DW:.*]] = stablehlo.dot_general %{{.*}}, %[[R]], {{.*}} -> tensor<2x48xbf16>
// CONV:         %[[DW32:.*]] = stablehlo.convert %[[DW]] : (tensor<2x48xbf16>) -> tensor<2x48xf32>
// CONV:         %[[DWT:.*]] = stablehlo.transpose %[[DW32]], dims = [1, 0] : (tensor<2x48xf32>) -> tensor<48x2xf32>
// CONV:         %[[G:.*]] = stablehlo.dot_general {{.*}} -> tensor<1x48xbf16>
// CONV:         %[[GR:.*]] = stablehlo.reshape %[[G]] : (tensor<1x48xbf16>) -> tensor<1x4x4x3xbf16>
// CONV:         stablehlo.multiply %[[GR]], %{{.*}} : tensor<1x4x4x3xbf16>
// CONV:         %[[DF:.*]] = stablehlo.convolution({{.*}}) {{.*}} -> tensor<3x3x2x3xf32>
// CONV:         return %[[DF]], %[[DWT]] : tensor<3x3x2x3xf32>, tensor<48x2xf32>

// jax.checkpoint: the sine/cosine (deny) stay f32; the optimization_barrier that remat
// puts on its residuals passes each operand through as it is: the parameters and the
// input, which only matrix ops read (through their converts), stay f32, and the
// incoming gradient, a dot's 16-bit result that the next dot reads, crosses it in bf16.
// REMAT-LABEL: func.func public @main
// REMAT:         stablehlo.sine %{{.*}} : tensor<2x4xf32>
// REMAT:         stablehlo.optimization_barrier %arg1, %arg0, %{{.*}} : tensor<4x4xf32>, tensor<2x4xf32>, tensor<2x4xbf16>
// REMAT:         stablehlo.cosine %{{.*}} : tensor<2x4xf32>

// Layer norm, GELU and softmax exactly as JAX lowers them: the layer norm's sums and
// rsqrt (and, deny winning, everything that feeds them) stay f32; the GELU between the
// two dots is bf16 from the first dot's 16-bit result to the second dot's operand; the
// softmax's input dot, max and subtract are bf16 (they reach the last dot through the
// exp), its exp, sum and divide stay f32, and its output is converted for the last dot,
// which returns bf16: the f32 sum of the loss converts it up.
// BLOCK-LABEL: func.func public @main
// BLOCK:         stablehlo.reduce(%arg4 init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// BLOCK:         stablehlo.rsqrt %{{.*}} : tensor<2x1xf32>
// BLOCK:         stablehlo.broadcast_in_dim %arg0, dims = [1] : (tensor<4xf32>) -> tensor<1x4xf32>
// BLOCK:         %[[LN:.*]] = stablehlo.multiply %{{.*}}, %{{.*}} : tensor<2x4xf32>
// BLOCK:         %[[LN16:.*]] = stablehlo.convert %[[LN]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// BLOCK:         %[[H:.*]] = stablehlo.dot_general %[[LN16]], {{.*}} -> tensor<2x4xbf16>
// BLOCK:         stablehlo.multiply %[[H]], %[[H]] : tensor<2x4xbf16>
// BLOCK:         stablehlo.tanh %{{.*}} : tensor<2x4xbf16>
// BLOCK:         %[[G:.*]] = stablehlo.multiply %[[H]], %{{.*}} : tensor<2x4xbf16>
// BLOCK:         %[[L:.*]] = stablehlo.dot_general %[[G]], {{.*}} -> tensor<2x4xbf16>
// BLOCK:         stablehlo.reduce(%[[L]] init: %{{.*}}) applies stablehlo.maximum {{.*}} -> tensor<2xbf16>
// BLOCK:         %[[S:.*]] = stablehlo.subtract %[[L]], %{{.*}} : tensor<2x4xbf16>
// BLOCK:         %[[S32:.*]] = stablehlo.convert %[[S]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// BLOCK:         %[[E:.*]] = stablehlo.exponential %[[S32]] : tensor<2x4xf32>
// BLOCK:         stablehlo.reduce(%[[E]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// BLOCK:         %[[P:.*]] = stablehlo.divide %[[E]], %{{.*}} : tensor<2x4xf32>
// BLOCK:         %[[P16:.*]] = stablehlo.convert %[[P]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// BLOCK:         %[[O:.*]] = stablehlo.dot_general %[[P16]], {{.*}} -> tensor<2x4xbf16>
// BLOCK:         %[[O32:.*]] = stablehlo.convert %[[O]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// BLOCK:         stablehlo.reduce(%[[O32]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<f32>

// JSON:      "propagation": {
// JSON:        "ops": {
// JSON:          "tanh": {
// JSON-NEXT:       "painted": 0,
// JSON-NEXT:       "f32": {
// JSON-NEXT:         "combines the model's values with f32 data, as JAX's promotion does": 1
// JSON:        "functions": [
// JSON:          "function": "main",
// JSON:          "clones": 0
