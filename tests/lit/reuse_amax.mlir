// A recomputed activation's amax read from the loop that took it first
// (hlo-amp-reuse-amax): the backward loop recomputes tanh(R[j]) and its amax; the forward
// loop took amax(tanh(h)) of the carry h it stores as R[i], so it keeps that amax as row i
// of a new carry and the backward reads row j.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-reuse-amax | filecheck %s --enable-var-scope
// Idempotence: a second run changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-reuse-amax \
// RUN:   | hlo-amp-opt --split-input-file --pass hlo-amp-reuse-amax | filecheck %s --enable-var-scope
// A real JAX lowering under the fp8 preset (tests/lit/inputs/make_inputs.py:
// fp8_scan_grad): the backward loop's amax of the saved activation is the forward's.
// RUN: hlo-amp-opt %S/inputs/fp8_scan_grad.mlir --policy 'fp8,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=SCAN
// RUN: hlo-amp-opt %S/inputs/fp8_scan_grad.mlir --policy 'fp8,first_matrix_op=none,last_matrix_op=none' \
// RUN:   --report - -o /dev/null 2>&1 | filecheck %s --check-prefix=NOTE

// CHECK-LABEL: func.func public @reuse
// CHECK:         %[[ROWS0:.*]] = stablehlo.constant dense<0.000000e+00> : tensor<3xbf16>
// CHECK:         %[[FWD:.*]]:5 = stablehlo.while(%[[I:[^ ]*]] = %{{.*}}, %{{.*}} = %{{.*}}, %{{.*}} = %{{.*}}, %{{.*}} = %{{.*}}, %[[ROWS:[^ ]*]] = %[[ROWS0]])
// CHECK:         } do {
// CHECK:           %[[AMAX:.*]] = stablehlo.reduce
// CHECK:           %[[ROW:.*]] = stablehlo.reshape %[[AMAX]] : (tensor<bf16>) -> tensor<1xbf16>
// CHECK:           %[[KEPT:.*]] = stablehlo.dynamic_update_slice %[[ROWS]], %[[ROW]], %[[I]]
// CHECK:           stablehlo.return {{.*}}, %[[KEPT]] :
// CHECK:         stablehlo.while({{.*}}, %[[IN:[^ ]*]] = %[[FWD]]#4)
// CHECK:         } do {
// CHECK:           %[[J:.*]] = stablehlo.subtract
// CHECK-NOT:       stablehlo.reduce
// CHECK:           %[[PICK:.*]] = stablehlo.dynamic_slice %[[IN]], %[[J]], sizes = [1] : (tensor<3xbf16>, tensor<i32>) -> tensor<1xbf16>
// CHECK:           %[[B:.*]] = stablehlo.reshape %[[PICK]] : (tensor<1xbf16>) -> tensor<bf16>
// CHECK:           stablehlo.maximum %{{.*}}, %[[B]]
// CHECK-NOT:       stablehlo.reduce
// CHECK:           stablehlo.return
func.func public @reuse(%x: tensor<4x8xbf16>) -> (tensor<bf16>, tensor<bf16>) {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %empty = stablehlo.constant dense<0.0> : tensor<3x4x8xbf16>
  %z = stablehlo.constant dense<0.0> : tensor<bf16>
  %fwd:4 = stablehlo.while(%i = %c0, %h = %x, %r = %empty, %acc = %z) : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>
   cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %t = stablehlo.tanh %h : tensor<4x8xbf16>
    %abs = stablehlo.abs %t : tensor<4x8xbf16>
    %zero = stablehlo.constant dense<0.0> : tensor<bf16>
    %m = stablehlo.reduce(%abs init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
    %acc2 = stablehlo.maximum %acc, %m : tensor<bf16>
    %row = stablehlo.reshape %h : (tensor<4x8xbf16>) -> tensor<1x4x8xbf16>
    %r2 = stablehlo.dynamic_update_slice %r, %row, %i, %c0, %c0 : (tensor<3x4x8xbf16>, tensor<1x4x8xbf16>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<3x4x8xbf16>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i2 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i2, %t, %r2, %acc2 : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>
  }
  %bwd:3 = stablehlo.while(%k = %c0, %rb = %fwd#2, %accb = %z) : tensor<i32>, tensor<3x4x8xbf16>, tensor<bf16>
   cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %k, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %c2 = stablehlo.constant dense<2> : tensor<i32>
    %j = stablehlo.subtract %c2, %k : tensor<i32>
    %s = stablehlo.dynamic_slice %rb, %j, %c0, %c0, sizes = [1, 4, 8] : (tensor<3x4x8xbf16>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x8xbf16>
    %h = stablehlo.reshape %s : (tensor<1x4x8xbf16>) -> tensor<4x8xbf16>
    %t = stablehlo.tanh %h : tensor<4x8xbf16>
    %abs = stablehlo.abs %t : tensor<4x8xbf16>
    %zero = stablehlo.constant dense<0.0> : tensor<bf16>
    %m = stablehlo.reduce(%abs init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
    %acc2 = stablehlo.maximum %accb, %m : tensor<bf16>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %k2 = stablehlo.add %k, %c1 : tensor<i32>
    stablehlo.return %k2, %rb, %acc2 : tensor<i32>, tensor<3x4x8xbf16>, tensor<bf16>
  }
  return %fwd#3, %bwd#2 : tensor<bf16>, tensor<bf16>
}

// -----

// The backward computes another function of R[j] (negate, not tanh): its amax stays.
// CHECK-LABEL: func.func public @other_op
// CHECK:         stablehlo.while({{.*}}) : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>{{$}}
// CHECK:         stablehlo.while
// CHECK:           stablehlo.negate
// CHECK:           stablehlo.reduce
func.func public @other_op(%x: tensor<4x8xbf16>) -> (tensor<bf16>, tensor<bf16>) {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %empty = stablehlo.constant dense<0.0> : tensor<3x4x8xbf16>
  %z = stablehlo.constant dense<0.0> : tensor<bf16>
  %fwd:4 = stablehlo.while(%i = %c0, %h = %x, %r = %empty, %acc = %z) : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>
   cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %t = stablehlo.tanh %h : tensor<4x8xbf16>
    %abs = stablehlo.abs %t : tensor<4x8xbf16>
    %zero = stablehlo.constant dense<0.0> : tensor<bf16>
    %m = stablehlo.reduce(%abs init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
    %acc2 = stablehlo.maximum %acc, %m : tensor<bf16>
    %row = stablehlo.reshape %h : (tensor<4x8xbf16>) -> tensor<1x4x8xbf16>
    %r2 = stablehlo.dynamic_update_slice %r, %row, %i, %c0, %c0 : (tensor<3x4x8xbf16>, tensor<1x4x8xbf16>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<3x4x8xbf16>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i2 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i2, %t, %r2, %acc2 : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>
  }
  %bwd:3 = stablehlo.while(%k = %c0, %rb = %fwd#2, %accb = %z) : tensor<i32>, tensor<3x4x8xbf16>, tensor<bf16>
   cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %k, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %s = stablehlo.dynamic_slice %rb, %k, %c0, %c0, sizes = [1, 4, 8] : (tensor<3x4x8xbf16>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x8xbf16>
    %h = stablehlo.reshape %s : (tensor<1x4x8xbf16>) -> tensor<4x8xbf16>
    %t = stablehlo.negate %h : tensor<4x8xbf16>
    %abs = stablehlo.abs %t : tensor<4x8xbf16>
    %zero = stablehlo.constant dense<0.0> : tensor<bf16>
    %m = stablehlo.reduce(%abs init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
    %acc2 = stablehlo.maximum %accb, %m : tensor<bf16>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %k2 = stablehlo.add %k, %c1 : tensor<i32>
    stablehlo.return %k2, %rb, %acc2 : tensor<i32>, tensor<3x4x8xbf16>, tensor<bf16>
  }
  return %fwd#3, %bwd#2 : tensor<bf16>, tensor<bf16>
}

// -----

// The forward counter starts at 1: row 0 of R is never written, so row j of the kept
// amaxes would not be the amax of R[j]. Nothing moves.
// CHECK-LABEL: func.func public @counter_from_one
// CHECK:         stablehlo.while({{.*}}) : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>{{$}}
// CHECK:         stablehlo.while
// CHECK:           stablehlo.tanh
// CHECK:           stablehlo.reduce
func.func public @counter_from_one(%x: tensor<4x8xbf16>) -> (tensor<bf16>, tensor<bf16>) {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %c1s = stablehlo.constant dense<1> : tensor<i32>
  %empty = stablehlo.constant dense<0.0> : tensor<3x4x8xbf16>
  %z = stablehlo.constant dense<0.0> : tensor<bf16>
  %fwd:4 = stablehlo.while(%i = %c1s, %h = %x, %r = %empty, %acc = %z) : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>
   cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %t = stablehlo.tanh %h : tensor<4x8xbf16>
    %abs = stablehlo.abs %t : tensor<4x8xbf16>
    %zero = stablehlo.constant dense<0.0> : tensor<bf16>
    %m = stablehlo.reduce(%abs init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
    %acc2 = stablehlo.maximum %acc, %m : tensor<bf16>
    %row = stablehlo.reshape %h : (tensor<4x8xbf16>) -> tensor<1x4x8xbf16>
    %r2 = stablehlo.dynamic_update_slice %r, %row, %i, %c0, %c0 : (tensor<3x4x8xbf16>, tensor<1x4x8xbf16>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<3x4x8xbf16>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i2 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i2, %t, %r2, %acc2 : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>
  }
  %bwd:3 = stablehlo.while(%k = %c0, %rb = %fwd#2, %accb = %z) : tensor<i32>, tensor<3x4x8xbf16>, tensor<bf16>
   cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %k, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %s = stablehlo.dynamic_slice %rb, %k, %c0, %c0, sizes = [1, 4, 8] : (tensor<3x4x8xbf16>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x8xbf16>
    %h = stablehlo.reshape %s : (tensor<1x4x8xbf16>) -> tensor<4x8xbf16>
    %t = stablehlo.tanh %h : tensor<4x8xbf16>
    %abs = stablehlo.abs %t : tensor<4x8xbf16>
    %zero = stablehlo.constant dense<0.0> : tensor<bf16>
    %m = stablehlo.reduce(%abs init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
    %acc2 = stablehlo.maximum %accb, %m : tensor<bf16>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %k2 = stablehlo.add %k, %c1 : tensor<i32>
    stablehlo.return %k2, %rb, %acc2 : tensor<i32>, tensor<3x4x8xbf16>, tensor<bf16>
  }
  return %fwd#3, %bwd#2 : tensor<bf16>, tensor<bf16>
}

// -----

// The forward stores tanh(h), not h: R[j] is what the forward's tanh returned, and the
// backward's tanh(R[j]) is another value. Nothing moves.
// CHECK-LABEL: func.func public @stores_another_value
// CHECK:         stablehlo.while({{.*}}) : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>{{$}}
// CHECK:         stablehlo.while
// CHECK:           stablehlo.tanh
// CHECK:           stablehlo.reduce
func.func public @stores_another_value(%x: tensor<4x8xbf16>) -> (tensor<bf16>, tensor<bf16>) {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %empty = stablehlo.constant dense<0.0> : tensor<3x4x8xbf16>
  %z = stablehlo.constant dense<0.0> : tensor<bf16>
  %fwd:4 = stablehlo.while(%i = %c0, %h = %x, %r = %empty, %acc = %z) : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>
   cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %t = stablehlo.tanh %h : tensor<4x8xbf16>
    %abs = stablehlo.abs %t : tensor<4x8xbf16>
    %zero = stablehlo.constant dense<0.0> : tensor<bf16>
    %m = stablehlo.reduce(%abs init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
    %acc2 = stablehlo.maximum %acc, %m : tensor<bf16>
    %row = stablehlo.reshape %t : (tensor<4x8xbf16>) -> tensor<1x4x8xbf16>
    %r2 = stablehlo.dynamic_update_slice %r, %row, %i, %c0, %c0 : (tensor<3x4x8xbf16>, tensor<1x4x8xbf16>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<3x4x8xbf16>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i2 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i2, %t, %r2, %acc2 : tensor<i32>, tensor<4x8xbf16>, tensor<3x4x8xbf16>, tensor<bf16>
  }
  %bwd:3 = stablehlo.while(%k = %c0, %rb = %fwd#2, %accb = %z) : tensor<i32>, tensor<3x4x8xbf16>, tensor<bf16>
   cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %k, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %s = stablehlo.dynamic_slice %rb, %k, %c0, %c0, sizes = [1, 4, 8] : (tensor<3x4x8xbf16>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x8xbf16>
    %h = stablehlo.reshape %s : (tensor<1x4x8xbf16>) -> tensor<4x8xbf16>
    %t = stablehlo.tanh %h : tensor<4x8xbf16>
    %abs = stablehlo.abs %t : tensor<4x8xbf16>
    %zero = stablehlo.constant dense<0.0> : tensor<bf16>
    %m = stablehlo.reduce(%abs init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x8xbf16>, tensor<bf16>) -> tensor<bf16>
    %acc2 = stablehlo.maximum %accb, %m : tensor<bf16>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %k2 = stablehlo.add %k, %c1 : tensor<i32>
    stablehlo.return %k2, %rb, %acc2 : tensor<i32>, tensor<3x4x8xbf16>, tensor<bf16>
  }
  return %fwd#3, %bwd#2 : tensor<bf16>, tensor<bf16>
}

// SCAN-LABEL: func.func public @main
// The forward loop keeps the saved activation's amax per layer, at its counter...
// SCAN:         %[[FWD:.*]]:9 = stablehlo.while(%{{[^ ]*}} = %{{[^ ]*}}, %[[I:[^ ]*]] = %c,
// SCAN:         } do {
// SCAN:           stablehlo.dynamic_update_slice %{{[^ ]*}}, %{{[^ ]*}}, %[[I]] : (tensor<2xbf16>, tensor<1xbf16>, tensor<i32>) -> tensor<2xbf16>
// ...and the backward loop reads it instead of reducing the saved stack again.
// SCAN-NOT:     stablehlo.abs %[[FWD]]#3
// SCAN:         stablehlo.while({{.*}}, %[[IN:[^ ]*]] = %[[FWD]]#6,
// SCAN:         } do {
// SCAN:           stablehlo.dynamic_slice %[[IN]], %{{[^ ]*}}, sizes = [1] : (tensor<2xbf16>, tensor<i32>) -> tensor<1xbf16>
// NOTE: reuse-amax: 1 amax(es) of a recomputed activation read from the loop that computed it first
