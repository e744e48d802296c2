// Two amaxes of one block whose tensors are computed from the same values
// (hlo-amp-merge-amax) become one reduction with two inputs, placed before the first op
// that reads either; the ops that read the first amax and came before the second tensor
// move after it. Left alone: a tensor computed from the other's amax, tensors with no
// value in common, and a pair whose move would carry an op with effects.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-merge-amax \
// RUN:   | filecheck %s --enable-var-scope
// Idempotence: a second run changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-merge-amax \
// RUN:   | hlo-amp-opt --split-input-file --pass hlo-amp-merge-amax \
// RUN:   | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-merge-amax --report - -o /dev/null 2>&1 \
// RUN:   | filecheck %s --check-prefix=NOTE

// CHECK-LABEL: func.func public @siblings
// CHECK-SAME:    (%[[P:[^:]*]]: tensor<4x8xf32>, %[[Q:[^:]*]]: tensor<4x8xf32>)
// CHECK:         %[[A:.*]] = stablehlo.multiply %[[P]], %[[Q]]
// CHECK:         %[[ABSA:.*]] = stablehlo.abs %[[A]]
// CHECK-NOT:     stablehlo.reduce
// CHECK:         %[[B:.*]] = stablehlo.add %[[P]], %[[Q]]
// CHECK:         %[[ABSB:.*]] = stablehlo.abs %[[B]]
// CHECK:         %[[R:.*]]:2 = stablehlo.reduce(%[[ABSA]] init: %{{.*}}), (%[[ABSB]] init: %{{.*}}) across dimensions = [0, 1]
// CHECK:         reducer(%[[LA:.*]]: tensor<f32>, %[[RA:.*]]: tensor<f32>) (%[[LB:.*]]: tensor<f32>, %[[RB:.*]]: tensor<f32>)
// CHECK:           %[[MA:.*]] = stablehlo.maximum %[[LA]], %[[RA]]
// CHECK:           %[[MB:.*]] = stablehlo.maximum %[[LB]], %[[RB]]
// CHECK:           stablehlo.return %[[MA]], %[[MB]]
// CHECK:         %[[SA:.*]] = stablehlo.broadcast_in_dim %[[R]]#0
// CHECK:         %[[QA:.*]] = stablehlo.divide %[[A]], %[[SA]]
// CHECK:         %[[SB:.*]] = stablehlo.broadcast_in_dim %[[R]]#1
// CHECK:         %[[QB:.*]] = stablehlo.divide %[[B]], %[[SB]]
// CHECK:         return %[[QA]], %[[QB]]
// One note per merging case: this one and @through_a_call.
// NOTE: merge-amax: 1 pair(s) of amaxes of tensors computed from the same values taken in one reduction each
// NOTE: merge-amax: 1 pair(s) of amaxes of tensors computed from the same values taken in one reduction each
func.func public @siblings(%p: tensor<4x8xf32>, %q: tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %a = stablehlo.multiply %p, %q : tensor<4x8xf32>
  %abs_a = stablehlo.abs %a : tensor<4x8xf32>
  %amax_a = stablehlo.reduce(%abs_a init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  %sa = stablehlo.broadcast_in_dim %amax_a, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
  %qa = stablehlo.divide %a, %sa : tensor<4x8xf32>
  %b = stablehlo.add %p, %q : tensor<4x8xf32>
  %abs_b = stablehlo.abs %b : tensor<4x8xf32>
  %amax_b = stablehlo.reduce(%abs_b init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  %sb = stablehlo.broadcast_in_dim %amax_b, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
  %qb = stablehlo.divide %b, %sb : tensor<4x8xf32>
  return %qa, %qb : tensor<4x8xf32>, tensor<4x8xf32>
}

// -----

// The second tensor is computed from the first's scaled value: left as it is.
// CHECK-LABEL: func.func public @dependent
// CHECK:         stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.maximum across dimensions = [0, 1]
// CHECK:         stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.maximum across dimensions = [0, 1]
// CHECK-NOT:     stablehlo.reduce
// CHECK:         return
func.func public @dependent(%p: tensor<4x8xf32>, %q: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %a = stablehlo.multiply %p, %q : tensor<4x8xf32>
  %abs_a = stablehlo.abs %a : tensor<4x8xf32>
  %amax_a = stablehlo.reduce(%abs_a init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  %sa = stablehlo.broadcast_in_dim %amax_a, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
  %qa = stablehlo.divide %a, %sa : tensor<4x8xf32>
  %b = stablehlo.add %qa, %p : tensor<4x8xf32>
  %abs_b = stablehlo.abs %b : tensor<4x8xf32>
  %amax_b = stablehlo.reduce(%abs_b init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  %sb = stablehlo.broadcast_in_dim %amax_b, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
  %qb = stablehlo.divide %b, %sb : tensor<4x8xf32>
  return %qb : tensor<4x8xf32>
}

// -----

// No value in common (p*q and r+r), and a pair whose move would carry a custom call (an
// op that may have effects): both left as they are.
// CHECK-LABEL: func.func public @apart
// CHECK:         stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.maximum across dimensions = [0, 1]
// CHECK:         stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.maximum across dimensions = [0, 1]
// CHECK:         return
// CHECK-LABEL: func.func public @effects
// CHECK:         stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.maximum across dimensions = [0, 1]
// CHECK:         stablehlo.custom_call @side_effect
// CHECK:         stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.maximum across dimensions = [0, 1]
// CHECK:         return
func.func public @apart(%p: tensor<4x8xf32>, %q: tensor<4x8xf32>, %r: tensor<4x8xf32>) -> (tensor<f32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %a = stablehlo.multiply %p, %q : tensor<4x8xf32>
  %abs_a = stablehlo.abs %a : tensor<4x8xf32>
  %amax_a = stablehlo.reduce(%abs_a init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  %b = stablehlo.add %r, %r : tensor<4x8xf32>
  %abs_b = stablehlo.abs %b : tensor<4x8xf32>
  %amax_b = stablehlo.reduce(%abs_b init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  return %amax_a, %amax_b : tensor<f32>, tensor<f32>
}
func.func public @effects(%p: tensor<4x8xf32>, %q: tensor<4x8xf32>) -> (tensor<f32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %a = stablehlo.multiply %p, %q : tensor<4x8xf32>
  %abs_a = stablehlo.abs %a : tensor<4x8xf32>
  %amax_a = stablehlo.reduce(%abs_a init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  %logged = stablehlo.custom_call @side_effect(%amax_a) {has_side_effect = true} : (tensor<f32>) -> tensor<f32>
  %b = stablehlo.add %p, %q : tensor<4x8xf32>
  %abs_b = stablehlo.abs %b : tensor<4x8xf32>
  %amax_b = stablehlo.reduce(%abs_b init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
  return %logged, %amax_b : tensor<f32>, tensor<f32>
}

// -----

// Both tensors computed before either amax is read: nothing moves. Through a function
// call (jax's custom_jvp silu), the pair still shares the gate.
// CHECK-LABEL: func.func public @through_a_call
// CHECK:         %[[R:.*]]:2 = stablehlo.reduce
// CHECK:         return %[[R]]#0, %[[R]]#1
func.func public @through_a_call(%g: tensor<4x8xbf16>, %u: tensor<4x8xbf16>) -> (tensor<bf16>, tensor<bf16>) {
  %zero = stablehlo.constant dense<0.0> : tensor<bf16>
  %s = func.call @silu(%g) : (tensor<4x8xbf16>) -> tensor<4x8xbf16>
  %a = stablehlo.multiply %s, %u : tensor<4x8xbf16>
  %b = stablehlo.multiply %g, %u : tensor<4x8xbf16>
  %abs_a = stablehlo.abs %a : tensor<4x8xbf16>
  %amax_a = stablehlo.reduce(%abs_a init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
  %abs_b = stablehlo.abs %b : tensor<4x8xbf16>
  %amax_b = stablehlo.reduce(%abs_b init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
  return %amax_a, %amax_b : tensor<bf16>, tensor<bf16>
}
func.func private @silu(%x: tensor<4x8xbf16>) -> tensor<4x8xbf16> {
  %l = stablehlo.logistic %x : tensor<4x8xbf16>
  %y = stablehlo.multiply %x, %l : tensor<4x8xbf16>
  return %y : tensor<4x8xbf16>
}
