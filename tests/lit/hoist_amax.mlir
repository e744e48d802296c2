// A scanned weight's amax (hlo-amp-hoist-amax): the amax fp8.py takes of a layer's slice
// of a loop-invariant stack, in the loop body, becomes one amax per layer before the
// loop and a read of element i in the body. An amax of a private function's argument
// moves to its call sites first. Nothing else moves.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-hoist-amax | filecheck %s --enable-var-scope
// Idempotence: a second run changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-hoist-amax \
// RUN:   | hlo-amp-opt --split-input-file --pass hlo-amp-hoist-amax | filecheck %s --enable-var-scope
// A real JAX lowering under the fp8 preset (tests/lit/inputs/make_inputs.py:
// fp8_scan_grad): the weight's amax leaves the forward and the backward loop.
// RUN: hlo-amp-opt %S/inputs/fp8_scan_grad.mlir --policy 'fp8,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=SCAN
// RUN: hlo-amp-opt %S/inputs/fp8_scan_grad.mlir --policy 'fp8,first_matrix_op=none,last_matrix_op=none' \
// RUN:   --report - -o /dev/null 2>&1 | filecheck %s --check-prefix=NOTE

// The layer function takes the amax of its weight behind a remat barrier, through a
// convert; the scan body slices the stack with a call, as jax writes it.
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    (%[[X:.*]]: tensor<8x4xf32>, %[[W:.*]]: tensor<3x4x4xf32>)
// CHECK:         %[[BF:.*]] = stablehlo.convert %[[W]] : (tensor<3x4x4xf32>) -> tensor<3x4x4xbf16>
// CHECK:         %[[ABS:.*]] = stablehlo.abs %[[BF]]
// CHECK:         %[[ROWS:.*]] = stablehlo.reduce(%[[ABS]] init: %{{.*}}) applies stablehlo.maximum across dimensions = [1, 2] : (tensor<3x4x4xbf16>, tensor<bf16>) -> tensor<3xbf16>
// CHECK:         stablehlo.while(%{{.*}} = %[[X]], %{{.*}} = %[[W]], %{{.*}} = %{{.*}}, %[[R:.*]] = %[[ROWS]])
// CHECK:         } do {
// CHECK:           %[[SLICE:.*]] = func.call @index(%{{.*}}, %[[I:[^)]*]])
// CHECK-NOT:       stablehlo.abs
// CHECK:           %[[PICK:.*]] = stablehlo.dynamic_slice %[[R]], %[[I]], sizes = [1] : (tensor<3xbf16>, tensor<i32>) -> tensor<1xbf16>
// CHECK:           %[[AMAX:.*]] = stablehlo.reshape %[[PICK]] : (tensor<1xbf16>) -> tensor<bf16>
// CHECK:           func.call @layer(%{{.*}}, %[[SLICE]], %[[AMAX]])
// CHECK:           stablehlo.return %{{.*}}, %{{.*}}, %{{.*}}, %[[R]]
// CHECK-LABEL: func.func private @layer
// CHECK-SAME:    %[[LW:[^:]*]]: tensor<4x4xf32>, %[[LA:[^:]*]]: tensor<bf16>) -> tensor<8x4xf32>
// CHECK-NOT:     stablehlo.abs
// CHECK:         stablehlo.convert %[[LA]] : (tensor<bf16>) -> tensor<f32>
func.func public @main(%x: tensor<8x4xf32>, %w: tensor<3x4x4xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:3 = stablehlo.while(%h = %x, %ws = %w, %i = %c0) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %wi = func.call @index(%ws, %i) : (tensor<3x4x4xf32>, tensor<i32>) -> tensor<4x4xf32>
    %y = func.call @layer(%h, %wi) : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %y, %ws, %next : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>
  }
  return %r#0 : tensor<8x4xf32>
}
func.func private @index(%stack: tensor<3x4x4xf32>, %i: tensor<i32>) -> tensor<4x4xf32> {
  %c = stablehlo.constant dense<0> : tensor<i32>
  %s = stablehlo.dynamic_slice %stack, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
  %r = stablehlo.reshape %s : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
  return %r : tensor<4x4xf32>
}
func.func private @layer(%h: tensor<8x4xf32>, %w: tensor<4x4xf32>) -> tensor<8x4xf32> {
  %held:2 = stablehlo.optimization_barrier %h, %w : tensor<8x4xf32>, tensor<4x4xf32>
  %bf = stablehlo.convert %held#1 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
  %abs = stablehlo.abs %bf : tensor<4x4xbf16>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<bf16>
  %amax = stablehlo.reduce(%abs init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x4xbf16>, tensor<bf16>) -> tensor<bf16>
  %a32 = stablehlo.convert %amax : (tensor<bf16>) -> tensor<f32>
  %s = stablehlo.broadcast_in_dim %a32, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
  %w32 = stablehlo.convert %bf : (tensor<4x4xbf16>) -> tensor<4x4xf32>
  %q = stablehlo.divide %w32, %s : tensor<4x4xf32>
  %y = stablehlo.dot_general %held#0, %q, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
  return %y : tensor<8x4xf32>
}

// -----

// The slice written in the loop body itself. The stack the body updates is not
// invariant (its amax stays); the other is, and its amax leaves the loop.
// CHECK-LABEL: func.func public @direct
// CHECK:         stablehlo.reduce(%{{.*}}) applies stablehlo.maximum across dimensions = [0, 2] : (tensor<4x3x5xf32>, tensor<f32>) -> tensor<3xf32>
// CHECK-NOT:     stablehlo.reduce
// CHECK:         stablehlo.while
// CHECK:         } do {
// CHECK:           stablehlo.reduce(%{{.*}}) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x5xf32>, tensor<f32>) -> tensor<f32>
// CHECK:           stablehlo.dynamic_slice %{{.*}}, %{{.*}}, sizes = [1] : (tensor<3xf32>, tensor<i32>) -> tensor<1xf32>
// CHECK-NOT:       stablehlo.reduce
// CHECK:           stablehlo.return
func.func public @direct(%a: tensor<4x3x5xf32>, %b: tensor<4x3x5xf32>) -> (tensor<f32>, tensor<4x3x5xf32>) {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %r:4 = stablehlo.while(%i = %c0, %acc = %zero, %as = %a, %bs = %b) : tensor<i32>, tensor<f32>, tensor<4x3x5xf32>, tensor<4x3x5xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %z = stablehlo.constant dense<0> : tensor<i32>
    %sa = stablehlo.dynamic_slice %as, %z, %i, %z, sizes = [4, 1, 5] : (tensor<4x3x5xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<4x1x5xf32>
    %ra = stablehlo.reshape %sa : (tensor<4x1x5xf32>) -> tensor<4x5xf32>
    %sb = stablehlo.dynamic_slice %bs, %z, %i, %z, sizes = [4, 1, 5] : (tensor<4x3x5xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<4x1x5xf32>
    %rb = stablehlo.reshape %sb : (tensor<4x1x5xf32>) -> tensor<4x5xf32>
    %init = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %absa = stablehlo.abs %ra : tensor<4x5xf32>
    %ma = stablehlo.reduce(%absa init: %init) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x5xf32>, tensor<f32>) -> tensor<f32>
    %absb = stablehlo.abs %rb : tensor<4x5xf32>
    %mb = stablehlo.reduce(%absb init: %init) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x5xf32>, tensor<f32>) -> tensor<f32>
    %sum = stablehlo.add %ma, %mb : tensor<f32>
    %acc2 = stablehlo.add %acc, %sum : tensor<f32>
    %two = stablehlo.constant dense<2.000000e+00> : tensor<4x3x5xf32>
    %as2 = stablehlo.multiply %as, %two : tensor<4x3x5xf32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %next, %acc2, %as2, %bs : tensor<i32>, tensor<f32>, tensor<4x3x5xf32>, tensor<4x3x5xf32>
  }
  return %r#1, %r#2 : tensor<f32>, tensor<4x3x5xf32>
}

// -----

// Not amaxes of a slice: a reduction over some dimensions, a sum of magnitudes, an
// amax starting from -inf (not fp8.py's form), and an amax in a public function's
// entry block, all left as they are.
// CHECK-LABEL: func.func public @others
// CHECK:         stablehlo.while
// CHECK:         } do {
// CHECK-COUNT-3:   stablehlo.reduce
// CHECK-NOT:       stablehlo.dynamic_slice %{{.*}}, sizes = [1]
// CHECK:           stablehlo.return
// CHECK-LABEL: func.func public @entry
// CHECK:         stablehlo.reduce
func.func public @others(%a: tensor<3x4x5xf32>) -> tensor<f32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %r:3 = stablehlo.while(%i = %c0, %acc = %zero, %as = %a) : tensor<i32>, tensor<f32>, tensor<3x4x5xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %z = stablehlo.constant dense<0> : tensor<i32>
    %s = stablehlo.dynamic_slice %as, %i, %z, %z, sizes = [1, 4, 5] : (tensor<3x4x5xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x5xf32>
    %x = stablehlo.reshape %s : (tensor<1x4x5xf32>) -> tensor<4x5xf32>
    %init = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %abs = stablehlo.abs %x : tensor<4x5xf32>
    %rows = stablehlo.reduce(%abs init: %init) applies stablehlo.maximum across dimensions = [1] : (tensor<4x5xf32>, tensor<f32>) -> tensor<4xf32>
    %sum = stablehlo.reduce(%abs init: %init) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x5xf32>, tensor<f32>) -> tensor<f32>
    %m = stablehlo.reduce(%abs init: %ninf) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x5xf32>, tensor<f32>) -> tensor<f32>
    %r0 = stablehlo.slice %rows [0:1] : (tensor<4xf32>) -> tensor<1xf32>
    %r1 = stablehlo.reshape %r0 : (tensor<1xf32>) -> tensor<f32>
    %t = stablehlo.add %sum, %m : tensor<f32>
    %t2 = stablehlo.add %t, %r1 : tensor<f32>
    %acc2 = stablehlo.add %acc, %t2 : tensor<f32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %next, %acc2, %as : tensor<i32>, tensor<f32>, tensor<3x4x5xf32>
  }
  %e = func.call @entry(%a) : (tensor<3x4x5xf32>) -> tensor<f32>
  %out = stablehlo.add %r#1, %e : tensor<f32>
  return %out : tensor<f32>
}
func.func public @entry(%a: tensor<3x4x5xf32>) -> tensor<f32> {
  %init = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %abs = stablehlo.abs %a : tensor<3x4x5xf32>
  %m = stablehlo.reduce(%abs init: %init) applies stablehlo.maximum across dimensions = [0, 1, 2] : (tensor<3x4x5xf32>, tensor<f32>) -> tensor<f32>
  return %m : tensor<f32>
}

// SCAN-LABEL: func.func public @main
// SCAN:         %[[WROWS:.*]] = stablehlo.reduce(%{{.*}}) applies stablehlo.maximum across dimensions = [1, 2] : (tensor<2x32x32xbf16>, tensor<bf16>) -> tensor<2xbf16>
// SCAN:         %[[FWD:.*]]:{{[0-9]+}} = stablehlo.while({{.*}}, %{{.*}} = %[[WROWS]]{{[,)]}}
// SCAN:           stablehlo.dynamic_slice %{{.*}}, %{{.*}}, sizes = [1] : (tensor<2xbf16>, tensor<i32>) -> tensor<1xbf16>
// SCAN:           func.call @closed_call(
// The backward loop: its weight's amax per layer too. The saved activations' amax is the
// one the forward loop took (reuse_amax runs first: tests/lit/reuse_amax.mlir).
// SCAN-NOT:     stablehlo.abs %[[FWD]]#3
// SCAN:         stablehlo.reduce(%{{.*}}) applies stablehlo.maximum across dimensions = [1, 2] : (tensor<2x32x32xbf16>, tensor<bf16>) -> tensor<2xbf16>
// SCAN:         stablehlo.while
// SCAN-LABEL: func.func private @closed_call(
// SCAN-SAME:    tensor<bf16>
// NOTE: hoist-amax: 2 amax(es) of a scanned tensor's slice taken for every slice before the loop, not in its body

// -----

// A loop whose results carry shardings (Shardy's attribute) keeps its carries: a new
// one would need a sharding of its own. Its amax stays in the body.
// CHECK-LABEL: func.func public @sharded_loop
// CHECK-NOT:     stablehlo.reduce
// CHECK:         stablehlo.while
// CHECK:         } do {
// CHECK:           stablehlo.reduce(%{{.*}}) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x5xf32>, tensor<f32>) -> tensor<f32>
// CHECK-NOT:       stablehlo.dynamic_slice %{{.*}}, sizes = [1]
// CHECK:           stablehlo.return
sdy.mesh @mesh = <["x"=2]>
func.func public @sharded_loop(%a: tensor<3x4x5xf32>) -> tensor<f32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %r:3 = stablehlo.while(%i = %c0, %acc = %zero, %as = %a) : tensor<i32>, tensor<f32>, tensor<3x4x5xf32>
   attributes {sdy.sharding = #sdy.sharding_per_value<[<@mesh, []>, <@mesh, []>, <@mesh, [{}, {"x"}, {}]>]>}
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %z = stablehlo.constant dense<0> : tensor<i32>
    %s = stablehlo.dynamic_slice %as, %i, %z, %z, sizes = [1, 4, 5] : (tensor<3x4x5xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x5xf32>
    %x = stablehlo.reshape %s : (tensor<1x4x5xf32>) -> tensor<4x5xf32>
    %init = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %abs = stablehlo.abs %x : tensor<4x5xf32>
    %m = stablehlo.reduce(%abs init: %init) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<4x5xf32>, tensor<f32>) -> tensor<f32>
    %acc2 = stablehlo.add %acc, %m : tensor<f32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %next, %acc2, %as : tensor<i32>, tensor<f32>, tensor<3x4x5xf32>
  }
  return %r#1 : tensor<f32>
}
