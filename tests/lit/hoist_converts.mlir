// Loop-invariant converts (hlo-amp-cleanup): a convert in a while body whose operand is
// the same on every iteration is computed once, before the loop.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-cleanup | filecheck %s --enable-var-scope
// Idempotence: cleaning up cleaned-up output changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-cleanup \
// RUN:   | hlo-amp-opt --split-input-file --pass hlo-amp-cleanup | filecheck %s --enable-var-scope
// A real JAX lowering (tests/lit/inputs/make_inputs.py: nested_scan), the whole bf16
// pipeline, once and twice (idempotence):
// RUN: hlo-amp-opt %S/inputs/nested_scan.mlir --policy bf16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=SCAN
// RUN: hlo-amp-opt %S/inputs/nested_scan.mlir --policy bf16 | hlo-amp-opt --policy bf16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=SCAN
// RUN: hlo-amp-opt %S/inputs/nested_scan.mlir --policy bf16 --report - -o /dev/null 2>&1 \
// RUN:   | filecheck %s --check-prefix=NOTE

// jax.lax.scan inside jax.lax.scan, the weights closed over: each scan carries them
// unchanged and calls its step (@closed_call, @closed_call_1) from the loop body. The
// weights' convert leaves the inner step, the inner loop, the outer step and the outer
// loop: it runs once, in @main, and both loops carry the bf16 copy.
// SCAN-LABEL: func.func public @main
// SCAN-SAME:    (%arg0: tensor<4x4xf32>, %arg1: tensor<2x3x2x4xf32>) -> (tensor<f32> {jax.result_info = "result"})
// SCAN:         %[[W16:.*]] = stablehlo.convert %arg0 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// SCAN:         stablehlo.while({{.*}}, %[[OW16:.*]] = %[[W16]]) : tensor<2x3x2x4xf32>, tensor<4x4xf32>, tensor<i32>, tensor<2x4xf32>, tensor<4x4xbf16>
// SCAN-NOT:     stablehlo.convert
// SCAN:         func.call @closed_call({{.*}}, %[[OW16]]) : (tensor<4x4xf32>, tensor<2x4xf32>, tensor<3x2x4xf32>, tensor<4x4xbf16>) -> tensor<2x4xf32>
// SCAN-NOT:     stablehlo.convert
// SCAN:         stablehlo.return {{.*}}, %[[OW16]] : {{.*}}, tensor<4x4xbf16>
// SCAN-NOT:     stablehlo.convert
// SCAN:         return
// SCAN-LABEL: func.func private @closed_call(
// SCAN-SAME:    %[[A16:[^:]*]]: tensor<4x4xbf16>) -> tensor<2x4xf32>
// SCAN-NOT:     stablehlo.convert
// SCAN:         stablehlo.while({{.*}}, %[[IW16:.*]] = %[[A16]]) : tensor<3x2x4xf32>, tensor<4x4xf32>, tensor<i32>, tensor<2x4xf32>, tensor<4x4xbf16>
// SCAN-NOT:     stablehlo.convert
// SCAN:         func.call @closed_call_1(%[[IW16]], {{.*}}) : (tensor<4x4xbf16>, tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
// SCAN-NOT:     stablehlo.convert
// SCAN:         return
// SCAN-LABEL: func.func private @closed_call_1(
// SCAN-SAME:    %[[W:[^:]*]]: tensor<4x4xbf16>, %[[H:[^:]*]]: tensor<2x4xf32>
// SCAN:         %[[H16:.*]] = stablehlo.convert %[[H]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// SCAN-NOT:     stablehlo.convert
// SCAN:         stablehlo.dot_general %[[H16]], %[[W]], {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>

// NOTE: "cleanup: {{.*}}, hoisted 2 loop-invariant convert(s) out of while loops"

// A carry the body returns unchanged (scan's weights): its convert moves before the
// loop and becomes a new bf16 carry, returned unchanged; the body converts nothing.
// CHECK-LABEL: func.func @invariant_carry
// CHECK-SAME:    (%[[H0:.*]]: tensor<2x4xf32>, %[[W:.*]]: tensor<4x4xf32>)
// CHECK:         %[[W16:.*]] = stablehlo.convert %[[W]] : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         %[[L:.*]]:4 = stablehlo.while(%[[I:.*]] = %{{.*}}, %[[H:.*]] = %[[H0]], %[[WC:.*]] = %[[W]], %[[WC16:.*]] = %[[W16]]) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
// CHECK:         cond {
// CHECK:           stablehlo.compare LT, %[[I]]
// CHECK:         } do {
// CHECK:           %[[H16:.*]] = stablehlo.convert %[[H]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK-NOT:       stablehlo.convert
// CHECK:           %[[D:.*]] = stablehlo.dot_general %[[H16]], %[[WC16]], {{.*}} -> tensor<2x4xf32>
// CHECK-NOT:       stablehlo.convert
// CHECK:           stablehlo.return %{{.*}}, %[[D]], %[[WC]], %[[WC16]] : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
// CHECK:         }
// CHECK:         return %[[L]]#1 : tensor<2x4xf32>
func.func @invariant_carry(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:3 = stablehlo.while(%i = %c0, %h = %h0, %wc = %w) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %h16 = stablehlo.convert %h : (tensor<2x4xf32>) -> tensor<2x4xbf16>
    %w16 = stablehlo.convert %wc : (tensor<4x4xf32>) -> tensor<4x4xbf16>
    %d = stablehlo.dot_general %h16, %w16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %d, %wc : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}

// -----

// A value defined outside the loop and read in the body: the convert moves before the
// loop and the body reads it from above; no new carry.
// CHECK-LABEL: func.func @captured
// CHECK-SAME:    (%[[H0:.*]]: tensor<2x4xf32>, %[[W:.*]]: tensor<4x4xf32>)
// CHECK:         %[[W16:.*]] = stablehlo.convert %[[W]] : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         stablehlo.while(%{{.*}} = %{{.*}}, %{{.*}} = %[[H0]]) : tensor<i32>, tensor<2x4xf32>
// CHECK:         } do {
// CHECK:           %[[H16:.*]] = stablehlo.convert
// CHECK-NOT:       stablehlo.convert
// CHECK:           stablehlo.dot_general %[[H16]], %[[W16]], {{.*}} -> tensor<2x4xf32>
// CHECK:           stablehlo.return {{.*}} : tensor<i32>, tensor<2x4xf32>
func.func @captured(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:2 = stablehlo.while(%i = %c0, %h = %h0) : tensor<i32>, tensor<2x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %h16 = stablehlo.convert %h : (tensor<2x4xf32>) -> tensor<2x4xbf16>
    %w16 = stablehlo.convert %w : (tensor<4x4xf32>) -> tensor<4x4xbf16>
    %d = stablehlo.dot_general %h16, %w16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %d : tensor<i32>, tensor<2x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}

// -----

// Values that change between iterations stay converted in the body: the hidden state
// (updated), a carry the body returns at another position (swapped) and a value the
// body computes.
// CHECK-LABEL: func.func @changed_carries
// CHECK:         stablehlo.while({{.*}}) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>
// CHECK-NOT:     stablehlo.convert
// CHECK:         } do {
// CHECK:           stablehlo.convert %{{.*}} : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:           stablehlo.convert %{{.*}} : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:           %[[T:.*]] = stablehlo.tanh
// CHECK:           stablehlo.convert %[[T]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:           stablehlo.return {{.*}} : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>
func.func @changed_carries(%h0: tensor<2x4xf32>, %a: tensor<4x4xf32>, %b: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:4 = stablehlo.while(%i = %c0, %h = %h0, %x = %a, %y = %b) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %h16 = stablehlo.convert %h : (tensor<2x4xf32>) -> tensor<2x4xbf16>
    %x16 = stablehlo.convert %x : (tensor<4x4xf32>) -> tensor<4x4xbf16>
    %d = stablehlo.dot_general %h16, %x16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
    %t = stablehlo.tanh %d : tensor<2x4xf32>
    %t16 = stablehlo.convert %t : (tensor<2x4xf32>) -> tensor<2x4xbf16>
    %e = stablehlo.dot_general %t16, %x16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %e, %y, %x : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}

// -----

// Nested loops, the weights carried unchanged by both: the convert leaves the inner
// loop as an inner carry, then the outer loop as an outer carry; neither body converts.
// CHECK-LABEL: func.func @nested
// CHECK-SAME:    (%[[H0:.*]]: tensor<2x4xf32>, %[[W:.*]]: tensor<4x4xf32>)
// CHECK:         %[[W16:.*]] = stablehlo.convert %[[W]] : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         stablehlo.while(%{{.*}} = %{{.*}}, %{{.*}} = %[[H0]], %[[OW:.*]] = %[[W]], %[[OW16:.*]] = %[[W16]]) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.while(%{{.*}} = %{{.*}}, %{{.*}} = %{{.*}}, %[[IW:.*]] = %[[OW]], %[[IW16:.*]] = %[[OW16]]) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert %[[IW]]
// CHECK:           stablehlo.dot_general %{{.*}}, %[[IW16]], {{.*}} -> tensor<2x4xf32>
// CHECK:           stablehlo.return {{.*}}, %[[IW]], %[[IW16]] : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.return {{.*}}, %[[OW]], %[[OW16]] : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
func.func @nested(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:3 = stablehlo.while(%i = %c0, %h = %h0, %ow = %w) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %s:3 = stablehlo.while(%j = %c0, %g = %h, %iw = %ow) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
    cond {
      %c2 = stablehlo.constant dense<2> : tensor<i32>
      %q = stablehlo.compare LT, %j, %c2, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %q : tensor<i1>
    } do {
      %g16 = stablehlo.convert %g : (tensor<2x4xf32>) -> tensor<2x4xbf16>
      %w16 = stablehlo.convert %iw : (tensor<4x4xf32>) -> tensor<4x4xbf16>
      %d = stablehlo.dot_general %g16, %w16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
      %c1 = stablehlo.constant dense<1> : tensor<i32>
      %j1 = stablehlo.add %j, %c1 : tensor<i32>
      stablehlo.return %j1, %d, %iw : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
    }
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %s#1, %ow : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}

// -----

// Two loops convert the same weights: hoisted out of both, then shared (one convert).
// CHECK-LABEL: func.func @two_loops
// CHECK-SAME:    (%[[H0:.*]]: tensor<2x4xf32>, %[[W:.*]]: tensor<4x4xf32>)
// CHECK:         %[[W16:.*]] = stablehlo.convert %[[W]] : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert %[[W]]
// CHECK:         stablehlo.while({{.*}}, %{{.*}} = %[[W16]]) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert %[[W]]
// CHECK:         stablehlo.while({{.*}}, %{{.*}} = %[[W16]]) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
// CHECK-NOT:     stablehlo.convert %[[W]]
// CHECK:         return
func.func @two_loops(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:3 = stablehlo.while(%i = %c0, %h = %h0, %wc = %w) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %w16 = stablehlo.convert %wc : (tensor<4x4xf32>) -> tensor<4x4xbf16>
    %h16 = stablehlo.convert %h : (tensor<2x4xf32>) -> tensor<2x4xbf16>
    %d = stablehlo.dot_general %h16, %w16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %d, %wc : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  %s:3 = stablehlo.while(%i = %c0, %h = %r#1, %wc = %w) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %w16 = stablehlo.convert %wc : (tensor<4x4xf32>) -> tensor<4x4xbf16>
    %h16 = stablehlo.convert %h : (tensor<2x4xf32>) -> tensor<2x4xbf16>
    %d = stablehlo.dot_general %h16, %w16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %d, %wc : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  return %s#1 : tensor<2x4xf32>
}

// -----

// JAX's scan puts the step in a private function: a convert of a callee argument that
// every call site passes a loop-invariant value is lifted to the call and then out of
// the loop; the callee's argument takes the converted type. The hidden state's convert
// stays in the callee.
// CHECK-LABEL: func.func @callee
// CHECK-SAME:    (%[[H0:.*]]: tensor<2x4xf32>, %[[W:.*]]: tensor<4x4xf32>)
// CHECK:         %[[W16:.*]] = stablehlo.convert %[[W]] : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         stablehlo.while({{.*}}, %[[WC:.*]] = %[[W]], %[[WC16:.*]] = %[[W16]]) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
// CHECK:         } do {
// CHECK-NOT:       stablehlo.convert
// CHECK:           func.call @step(%[[WC16]], %{{.*}}) : (tensor<4x4xbf16>, tensor<2x4xf32>) -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @step
// CHECK-SAME:    (%[[SW:.*]]: tensor<4x4xbf16>, %[[SH:.*]]: tensor<2x4xf32>) -> tensor<2x4xf32>
// CHECK:         %[[SH16:.*]] = stablehlo.convert %[[SH]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %[[SH16]], %[[SW]], {{.*}} -> tensor<2x4xf32>
func.func @callee(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:3 = stablehlo.while(%i = %c0, %h = %h0, %wc = %w) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %d = func.call @step(%wc, %h) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %d, %wc : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}
func.func private @step(%w: tensor<4x4xf32>, %h: tensor<2x4xf32>) -> tensor<2x4xf32> {
  %h16 = stablehlo.convert %h : (tensor<2x4xf32>) -> tensor<2x4xbf16>
  %w16 = stablehlo.convert %w : (tensor<4x4xf32>) -> tensor<4x4xbf16>
  %d = stablehlo.dot_general %h16, %w16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
  return %d : tensor<2x4xf32>
}

// -----

// The callee also reads the f32 weights: they stay an argument and the bf16 copy is
// appended as a new one.
// CHECK-LABEL: func.func @callee_other_use
// CHECK:         %[[W16:.*]] = stablehlo.convert %arg1 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         stablehlo.while({{.*}}, %[[WC:.*]] = %arg1, %[[WC16:.*]] = %[[W16]])
// CHECK:         } do {
// CHECK-NOT:       stablehlo.convert
// CHECK:           func.call @step(%[[WC]], %{{.*}}, %[[WC16]]) : (tensor<4x4xf32>, tensor<2x4xf32>, tensor<4x4xbf16>) -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @step
// CHECK-SAME:    (%[[SW:.*]]: tensor<4x4xf32>, %[[SH:.*]]: tensor<2x4xf32>, %[[SW16:.*]]: tensor<4x4xbf16>) -> tensor<2x4xf32>
// CHECK-NOT:     stablehlo.convert %[[SW]]
// CHECK:         stablehlo.dot_general %{{.*}}, %[[SW16]], {{.*}} -> tensor<2x4xf32>
// CHECK:         stablehlo.dot_general %{{.*}}, %[[SW]], {{.*}} -> tensor<2x4xf32>
func.func @callee_other_use(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:3 = stablehlo.while(%i = %c0, %h = %h0, %wc = %w) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %d = func.call @step(%wc, %h) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %d, %wc : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}
func.func private @step(%w: tensor<4x4xf32>, %h: tensor<2x4xf32>) -> tensor<2x4xf32> {
  %h16 = stablehlo.convert %h : (tensor<2x4xf32>) -> tensor<2x4xbf16>
  %w16 = stablehlo.convert %w : (tensor<4x4xf32>) -> tensor<4x4xbf16>
  %d = stablehlo.dot_general %h16, %w16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
  %e = stablehlo.dot_general %d, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  return %e : tensor<2x4xf32>
}

// -----

// A callee also called outside any loop keeps its signature and its converts; a
// convert inside a case in the body is left alone (only the body's own block is read).
// CHECK-LABEL: func.func @left_alone
// CHECK:         call @step(%arg1, %arg0)
// CHECK:         stablehlo.while
// CHECK:         } do {
// CHECK:           func.call @step(
// CHECK:           stablehlo.case
// CHECK:             stablehlo.convert %{{.*}} : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK-LABEL: func.func private @step
// CHECK-SAME:    (%[[SW:.*]]: tensor<4x4xf32>, %{{.*}}: tensor<2x4xf32>)
// CHECK:         stablehlo.convert %[[SW]] : (tensor<4x4xf32>) -> tensor<4x4xbf16>
func.func @left_alone(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>, %k: tensor<i32>) -> tensor<2x4xf32> {
  %e = func.call @step(%w, %h0) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:3 = stablehlo.while(%i = %c0, %h = %e, %wc = %w) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %d = func.call @step(%wc, %h) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %b = "stablehlo.case"(%k) ({
      %w16 = stablehlo.convert %wc : (tensor<4x4xf32>) -> tensor<4x4xbf16>
      %d16 = stablehlo.convert %d : (tensor<2x4xf32>) -> tensor<2x4xbf16>
      %g = stablehlo.dot_general %d16, %w16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
      stablehlo.return %g : tensor<2x4xf32>
    }, {
      stablehlo.return %d : tensor<2x4xf32>
    }) : (tensor<i32>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %b, %wc : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}
func.func private @step(%w: tensor<4x4xf32>, %h: tensor<2x4xf32>) -> tensor<2x4xf32> {
  %h16 = stablehlo.convert %h : (tensor<2x4xf32>) -> tensor<2x4xbf16>
  %w16 = stablehlo.convert %w : (tensor<4x4xf32>) -> tensor<4x4xbf16>
  %d = stablehlo.dot_general %h16, %w16, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
  return %d : tensor<2x4xf32>
}

// -----

// One argument converted to two types (bf16 for one dot, f16 for another): each gets its
// own appended argument, converted at the call site from the original f32 value (never
// f16 -> bf16), and both leave the loop.
// CHECK-LABEL: func.func @two_types_of_one_argument
// CHECK-DAG:     %[[B:.*]] = stablehlo.convert %arg1 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK-DAG:     %[[H:.*]] = stablehlo.convert %arg1 : (tensor<4x4xf32>) -> tensor<4x4xf16>
// CHECK:         stablehlo.while({{.*}}, %[[WC:.*]] = %arg1, %[[WB:.*]] = %[[B]], %[[WH:.*]] = %[[H]])
// CHECK:         } do {
// CHECK-NOT:       stablehlo.convert
// CHECK:           func.call @step2(%[[WC]], %{{.*}}, %[[WB]], %[[WH]])
// CHECK-LABEL: func.func private @step2
// CHECK-SAME:    (%{{.*}}: tensor<4x4xf32>, %{{.*}}: tensor<2x4xf32>, %[[SB:.*]]: tensor<4x4xbf16>, %[[SH:.*]]: tensor<4x4xf16>)
// CHECK-NOT:     stablehlo.convert %arg0
// CHECK:         stablehlo.dot_general %{{.*}}, %[[SB]]
// CHECK:         stablehlo.dot_general %{{.*}}, %[[SH]]
func.func @two_types_of_one_argument(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:3 = stablehlo.while(%i = %c0, %h = %h0, %wc = %w) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %d = func.call @step2(%wc, %h) : (tensor<4x4xf32>, tensor<2x4xf32>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %d, %wc : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}
func.func private @step2(%w: tensor<4x4xf32>, %h: tensor<2x4xf32>) -> tensor<2x4xf32> {
  %h16 = stablehlo.convert %h : (tensor<2x4xf32>) -> tensor<2x4xbf16>
  %wb = stablehlo.convert %w : (tensor<4x4xf32>) -> tensor<4x4xbf16>
  %d = stablehlo.dot_general %h16, %wb, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
  %dh = stablehlo.convert %d : (tensor<2x4xf32>) -> tensor<2x4xf16>
  %wh = stablehlo.convert %w : (tensor<4x4xf32>) -> tensor<4x4xf16>
  %e = stablehlo.dot_general %dh, %wh, contracting_dims = [1] x [0] : (tensor<2x4xf16>, tensor<4x4xf16>) -> tensor<2x4xf32>
  return %e : tensor<2x4xf32>
}

// -----

// A convert of a hoisted carry's convert (jax 0.11.2's scan RNN under fp8: the carried
// weight rounded to bf16 and back to f32): both move before the loop; the second reads
// the first there, not the new bf16 carry, which exists only in the body.
// CHECK-LABEL: func.func @convert_of_a_carried_convert
// CHECK-SAME:    (%[[H0:.*]]: tensor<2x4xf32>, %[[W:.*]]: tensor<4x4xf32>)
// CHECK:         %[[W16:.*]] = stablehlo.convert %[[W]] : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         %[[W32:.*]] = stablehlo.convert %[[W16]] : (tensor<4x4xbf16>) -> tensor<4x4xf32>
// CHECK:         stablehlo.while(%{{.*}} = %{{.*}}, %{{.*}} = %[[H0]], %[[WC:.*]] = %[[W]], %[[WC16:.*]] = %[[W16]]) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
// CHECK:         } do {
// CHECK-NOT:       stablehlo.convert
// CHECK:           stablehlo.dot_general %{{.*}}, %[[W32]], {{.*}} -> tensor<2x4xf32>
// CHECK-NOT:       stablehlo.convert
// CHECK:           stablehlo.return {{.*}}, %[[WC]], %[[WC16]] : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>, tensor<4x4xbf16>
func.func @convert_of_a_carried_convert(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:3 = stablehlo.while(%i = %c0, %h = %h0, %wc = %w) : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %w16 = stablehlo.convert %wc : (tensor<4x4xf32>) -> tensor<4x4xbf16>
    %w32 = stablehlo.convert %w16 : (tensor<4x4xbf16>) -> tensor<4x4xf32>
    %d = stablehlo.dot_general %h, %w32, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %i1 = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %i1, %d, %wc : tensor<i32>, tensor<2x4xf32>, tensor<4x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}
