// A batch norm's variance keeps 2 * (x - mean) in f32 for its backward pass, x being a
// 16-bit convolution result that is kept too. On GPU the backward readers recompute it
// from x (behind an optimization_barrier, so that XLA's CSE does not merge the copy with
// the original) and the mean, which the private function returns as one more result:
// the forward pass no longer stores the f32 value (passes/recompute_residuals.py). The
// same in the caller's own block (a value centred by a parameter), where a forward
// reader keeps the original. A residual made from two 16-bit values is stored (a 16-bit
// copy of each would weigh as much), and without a GPU target nothing changes.
//
// RUN: hlo-amp-opt %s --pass hlo-amp-recompute-residuals --policy mixed_bfloat16 --target gpu \
// RUN:   | filecheck %s --check-prefix=GPU
// RUN: hlo-amp-opt %s --pass hlo-amp-recompute-residuals --policy mixed_bfloat16 --target tpu \
// RUN:   | filecheck %s --check-prefix=NONE
// RUN: hlo-amp-opt %s --pass hlo-amp-recompute-residuals --policy mixed_bfloat16 \
// RUN:   | filecheck %s --check-prefix=NONE
// RUN: hlo-amp-opt %s --policy mixed_bfloat16 --target gpu --report - -o /dev/null 2>&1 \
// RUN:   | filecheck %s --check-prefix=REPORT

// GPU-LABEL: func.func public @main
// GPU:         %[[V:.*]]:3 = call @_var(%arg0) : (tensor<8x16xbf16>) -> (tensor<1x16xf32>, tensor<8x16xf32>, tensor<1x16xf32>)
// GPU:         %[[B:.*]] = stablehlo.optimization_barrier %arg0 : tensor<8x16xbf16>
// GPU-DAG:     %[[X:.*]] = stablehlo.convert %[[B]] : (tensor<8x16xbf16>) -> tensor<8x16xf32>
// GPU-DAG:     %[[M:.*]] = stablehlo.broadcast_in_dim %[[V]]#2, dims = [0, 1]
// GPU:         %[[D:.*]] = stablehlo.subtract %[[X]], %[[M]]
// GPU:         %[[R:.*]] = stablehlo.multiply %{{.*}}, %[[D]]
// GPU:         stablehlo.multiply %[[R]], %arg3
// GPU:         %[[XC:.*]] = stablehlo.convert %arg0
// GPU:         %[[C:.*]] = stablehlo.subtract %[[XC]],
// GPU:         stablehlo.tanh %[[C]]
// GPU:         %[[B2:.*]] = stablehlo.optimization_barrier %arg0
// GPU:         %[[X2:.*]] = stablehlo.convert %[[B2]]
// GPU:         %[[C2:.*]] = stablehlo.subtract %[[X2]],
// GPU:         stablehlo.multiply %[[C2]], %arg3
// GPU-NOT:     optimization_barrier
// GPU:         %[[TWO:.*]] = stablehlo.multiply %[[XC]], %{{.*}}
// GPU:         stablehlo.multiply %[[TWO]], %arg3
// GPU-LABEL: func.func private @_var
// GPU-SAME:    -> (tensor<1x16xf32> {jax.result_info = "var"}, tensor<8x16xf32> {jax.result_info = "residual"}, tensor<1x16xf32>)
// GPU:         %[[MEAN:.*]] = stablehlo.divide
// GPU:         return %{{.*}}, %{{.*}}, %[[MEAN]]

// NONE-NOT:    optimization_barrier
// NONE:        call @_var(%arg0) : (tensor<8x16xbf16>) -> (tensor<1x16xf32>, tensor<8x16xf32>)
// NONE-NOT:    optimization_barrier

// REPORT: recompute-residuals: 2 f32 residual(s) of 1,024 B recomputed in the backward pass

func.func public @main(%x: tensor<8x16xbf16>, %y: tensor<8x16xbf16>, %s: tensor<16xf32>, %g: tensor<8x16xf32>)
    -> (tensor<1x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>) {
  %v:2 = call @_var(%x) : (tensor<8x16xbf16>) -> (tensor<1x16xf32>, tensor<8x16xf32>) loc("jit(step)/jvp(bn)/jit(_var)")
  %dv = stablehlo.multiply %v#1, %g : tensor<8x16xf32> loc("jit(step)/transpose(jvp(bn))/mul")
  %xc = stablehlo.convert %x : (tensor<8x16xbf16>) -> tensor<8x16xf32> loc("jit(step)/jvp(ln)/convert_element_type")
  %sb = stablehlo.broadcast_in_dim %s, dims = [1] : (tensor<16xf32>) -> tensor<8x16xf32> loc("jit(step)/jvp(ln)/broadcast_in_dim")
  %c = stablehlo.subtract %xc, %sb : tensor<8x16xf32> loc("jit(step)/jvp(ln)/sub")
  %fw = stablehlo.tanh %c : tensor<8x16xf32> loc("jit(step)/jvp(ln)/tanh")
  %dc = stablehlo.multiply %c, %g : tensor<8x16xf32> loc("jit(step)/transpose(jvp(ln))/mul")
  %yc = stablehlo.convert %y : (tensor<8x16xbf16>) -> tensor<8x16xf32> loc("jit(step)/jvp(two)/convert_element_type")
  %two = stablehlo.multiply %xc, %yc : tensor<8x16xf32> loc("jit(step)/jvp(two)/mul")
  %dtwo = stablehlo.multiply %two, %g : tensor<8x16xf32> loc("jit(step)/transpose(jvp(two))/mul")
  return %v#0, %dv, %fw, %dc, %dtwo : tensor<1x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>
}

func.func private @_var(%arg0: tensor<8x16xbf16>) -> (tensor<1x16xf32> {jax.result_info = "var"}, tensor<8x16xf32> {jax.result_info = "residual"}) {
  %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %0 = stablehlo.convert %arg0 : (tensor<8x16xbf16>) -> tensor<8x16xf32>
  %1 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [0] : (tensor<8x16xf32>, tensor<f32>) -> tensor<16xf32>
  %2 = stablehlo.broadcast_in_dim %1, dims = [1] : (tensor<16xf32>) -> tensor<1x16xf32>
  %n = stablehlo.constant dense<8.000000e+00> : tensor<f32>
  %3 = stablehlo.broadcast_in_dim %n, dims = [] : (tensor<f32>) -> tensor<1x16xf32>
  %4 = stablehlo.divide %2, %3 : tensor<1x16xf32>
  %5 = stablehlo.broadcast_in_dim %4, dims = [0, 1] : (tensor<1x16xf32>) -> tensor<8x16xf32>
  %6 = stablehlo.subtract %0, %5 : tensor<8x16xf32>
  %7 = stablehlo.multiply %6, %6 : tensor<8x16xf32>
  %cst2 = stablehlo.constant dense<2.000000e+00> : tensor<f32>
  %8 = stablehlo.broadcast_in_dim %cst2, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
  %9 = stablehlo.multiply %8, %6 : tensor<8x16xf32>
  %10 = stablehlo.reduce(%7 init: %cst) applies stablehlo.add across dimensions = [0] : (tensor<8x16xf32>, tensor<f32>) -> tensor<16xf32>
  %11 = stablehlo.broadcast_in_dim %10, dims = [1] : (tensor<16xf32>) -> tensor<1x16xf32>
  %12 = stablehlo.divide %11, %3 : tensor<1x16xf32>
  return %12, %9 : tensor<1x16xf32>, tensor<8x16xf32>
}
