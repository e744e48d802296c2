// jax.lax.scan's gradient: the forward loop stacks each iteration's residuals, the
// backward loop reads them back at its own index. An f32 residual made from a 16-bit
// value the forward loop stacks too (here a logistic, as a silu's) is made again in the
// backward loop from that value's slice; the f32 stack is no longer read, and XLA drops
// it (passes/stacked_residuals.py). A residual made from a value that is not stacked
// (the f32 carry `acc`) stays stored, and without a GPU target nothing changes.
//
// RUN: hlo-amp-opt %s --pass hlo-amp-recompute-residuals --policy mixed_bfloat16 --target gpu \
// RUN:   | filecheck %s --check-prefix=GPU
// RUN: hlo-amp-opt %s --pass hlo-amp-recompute-residuals --policy mixed_bfloat16 --target tpu \
// RUN:   | filecheck %s --check-prefix=NONE
// RUN: hlo-amp-opt %s --policy mixed_bfloat16 --target gpu --report - -o /dev/null 2>&1 \
// RUN:   | filecheck %s --check-prefix=REPORT

// GPU-LABEL: func.func public @main
// The forward loop is as it was: it still writes both stacks.
// GPU:         stablehlo.logistic
// GPU:         stablehlo.dynamic_update_slice
// GPU:         stablehlo.dynamic_update_slice
// GPU:         stablehlo.dynamic_update_slice
// The backward loop: the logistic again, from the 16-bit slice, and the product reads
// it; the f32 slice is read no more, exp(acc)'s still is.
// GPU:         %[[XS:.*]] = stablehlo.dynamic_slice %iterArg_{{[0-9]+}}, %iterArg, %c
// GPU:         %[[X:.*]] = stablehlo.reshape %[[XS]] : (tensor<1x4xbf16>) -> tensor<4xbf16>
// GPU:         %[[RS:.*]] = stablehlo.dynamic_slice {{.*}} -> tensor<1x4xf32>
// GPU:         %[[R:.*]] = stablehlo.reshape %[[RS]] : (tensor<1x4xf32>) -> tensor<4xf32>
// GPU:         %[[AS:.*]] = stablehlo.dynamic_slice {{.*}} -> tensor<1x4xf32>
// GPU:         %[[A:.*]] = stablehlo.reshape %[[AS]] : (tensor<1x4xf32>) -> tensor<4xf32>
// GPU:         %[[X32:.*]] = stablehlo.convert %[[X]]
// GPU:         %[[C:.*]] = stablehlo.convert %[[X]] : (tensor<4xbf16>) -> tensor<4xf32>
// GPU:         %[[L:.*]] = stablehlo.logistic %[[C]] : tensor<4xf32>
// GPU:         %[[GR:.*]] = stablehlo.multiply %[[L]], %[[X32]] : tensor<4xf32>
// GPU:         stablehlo.multiply %[[A]], %[[GR]] : tensor<4xf32>
// GPU-NOT:     %[[R]]

// NONE-LABEL: func.func public @main
// NONE-COUNT-1: stablehlo.logistic

// REPORT: recompute-residuals: 1 residual(s) a loop stacks for its backward loop (48 B of stacks)

func.func public @main(%arg0: tensor<3x4xbf16>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %c1 = stablehlo.constant dense<1> : tensor<i32>
  %c3 = stablehlo.constant dense<3> : tensor<i32>
  %xz = stablehlo.constant dense<0.0> : tensor<3x4xbf16>
  %rz = stablehlo.constant dense<0.0> : tensor<3x4xf32>
  %f:5 = stablehlo.while(%i = %c0, %acc = %arg1, %xstack = %xz, %rstack = %rz, %astack = %rz) : tensor<i32>, tensor<4xf32>, tensor<3x4xbf16>, tensor<3x4xf32>, tensor<3x4xf32>
   cond {
    %lt = stablehlo.compare LT, %i, %c3 : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %xs = stablehlo.dynamic_slice %arg0, %i, %c0, sizes = [1, 4] : (tensor<3x4xbf16>, tensor<i32>, tensor<i32>) -> tensor<1x4xbf16>
    %x = stablehlo.reshape %xs : (tensor<1x4xbf16>) -> tensor<4xbf16>
    %x32 = stablehlo.convert %x : (tensor<4xbf16>) -> tensor<4xf32>
    %r = stablehlo.logistic %x32 : tensor<4xf32>
    %a = stablehlo.exponential %acc : tensor<4xf32>
    %next = stablehlo.multiply %acc, %r : tensor<4xf32>
    %xu = stablehlo.reshape %x : (tensor<4xbf16>) -> tensor<1x4xbf16>
    %xstack2 = stablehlo.dynamic_update_slice %xstack, %xu, %i, %c0 : (tensor<3x4xbf16>, tensor<1x4xbf16>, tensor<i32>, tensor<i32>) -> tensor<3x4xbf16>
    %ru = stablehlo.reshape %r : (tensor<4xf32>) -> tensor<1x4xf32>
    %rstack2 = stablehlo.dynamic_update_slice %rstack, %ru, %i, %c0 : (tensor<3x4xf32>, tensor<1x4xf32>, tensor<i32>, tensor<i32>) -> tensor<3x4xf32>
    %au = stablehlo.reshape %a : (tensor<4xf32>) -> tensor<1x4xf32>
    %astack2 = stablehlo.dynamic_update_slice %astack, %au, %i, %c0 : (tensor<3x4xf32>, tensor<1x4xf32>, tensor<i32>, tensor<i32>) -> tensor<3x4xf32>
    %i2 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i2, %next, %xstack2, %rstack2, %astack2 : tensor<i32>, tensor<4xf32>, tensor<3x4xbf16>, tensor<3x4xf32>, tensor<3x4xf32>
  }
  %b:5 = stablehlo.while(%j = %c0, %g = %f#1, %xs2 = %f#2, %rs2 = %f#3, %as2 = %f#4) : tensor<i32>, tensor<4xf32>, tensor<3x4xbf16>, tensor<3x4xf32>, tensor<3x4xf32>
   cond {
    %lt = stablehlo.compare LT, %j, %c3 : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %xsl = stablehlo.dynamic_slice %xs2, %j, %c0, sizes = [1, 4] : (tensor<3x4xbf16>, tensor<i32>, tensor<i32>) -> tensor<1x4xbf16>
    %x = stablehlo.reshape %xsl : (tensor<1x4xbf16>) -> tensor<4xbf16>
    %rsl = stablehlo.dynamic_slice %rs2, %j, %c0, sizes = [1, 4] : (tensor<3x4xf32>, tensor<i32>, tensor<i32>) -> tensor<1x4xf32>
    %r = stablehlo.reshape %rsl : (tensor<1x4xf32>) -> tensor<4xf32>
    %asl = stablehlo.dynamic_slice %as2, %j, %c0, sizes = [1, 4] : (tensor<3x4xf32>, tensor<i32>, tensor<i32>) -> tensor<1x4xf32>
    %a = stablehlo.reshape %asl : (tensor<1x4xf32>) -> tensor<4xf32>
    %x32 = stablehlo.convert %x : (tensor<4xbf16>) -> tensor<4xf32>
    %gr = stablehlo.multiply %r, %x32 : tensor<4xf32>
    %ga = stablehlo.multiply %a, %gr : tensor<4xf32>
    %g2 = stablehlo.add %g, %ga : tensor<4xf32>
    %j2 = stablehlo.add %j, %c1 : tensor<i32>
    stablehlo.return %j2, %g2, %xs2, %rs2, %as2 : tensor<i32>, tensor<4xf32>, tensor<3x4xbf16>, tensor<3x4xf32>, tensor<3x4xf32>
  }
  return %b#1 : tensor<4xf32>
}
