// A scanned weight's fp8 quantisation (hlo-amp-hoist-quantize): once hoist_amax has made
// a layer's scale a function of element i of a vector before the loop (or of nothing
// that changes in it), the quantisation of slice i of a loop-invariant stack becomes
// one quantisation of the whole stack before the loop, each layer divided by its own
// scale, and a read of slice i of the fp8 stack in the body. A quantisation of a
// private function's argument moves to its call sites first. Backward loops, and
// activations, keep theirs; in a backward loop, one that remat's recomputed forward
// reads goes behind a layout fence.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-hoist-quantize | filecheck %s --enable-var-scope
// Only the two quantisations that read their slice through remat's barrier are rebuilt
// (a chain without converts that reads the slice directly is not).
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-hoist-quantize --report - -o /dev/null 2>&1 \
// RUN:   | filecheck %s --check-prefix=BARRIER
// BARRIER-COUNT-2: hoist-quantize barrier: 1 fp8
// BARRIER-NOT:     hoist-quantize barrier
// Idempotence: a second run changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-hoist-quantize --debug-info \
// RUN:   | hlo-amp-opt --split-input-file --pass hlo-amp-hoist-quantize | filecheck %s --enable-var-scope
// A real JAX lowering under the fp8 preset (tests/lit/inputs/make_inputs.py:
// fp8_scan_grad): the forward loop reads its weight from an fp8 stack.
// RUN: hlo-amp-opt %S/inputs/fp8_scan_grad.mlir --policy 'fp8,first_matrix_op=none,last_matrix_op=none' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=SCAN
// RUN: hlo-amp-opt %S/inputs/fp8_scan_grad.mlir --policy 'fp8,first_matrix_op=none,last_matrix_op=none' \
// RUN:   --report - -o /dev/null 2>&1 | filecheck %s --check-prefix=NOTE

// The layer quantises its weight behind a remat barrier, through a convert, by a scale
// computed from its amax argument (the form fp8.py and hoist_amax write); the scan body
// slices the stack with a call and picks the layer's amax from the rows it carries.
// The layer's activation is quantised too: it is no slice of a stack and stays.
// CHECK-LABEL: func.func public @main
// CHECK-SAME:    (%[[X:.*]]: tensor<8x4xf32>, %[[W:.*]]: tensor<3x4x4xf32>, %[[ROWS:.*]]: tensor<3xbf16>)
// CHECK:         %[[A32:.*]] = stablehlo.convert %[[ROWS]] : (tensor<3xbf16>) -> tensor<3xf32>
// CHECK:         stablehlo.compare GT, %{{.*}}, %{{.*}}, FLOAT : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xi1>
// CHECK:         %[[S:.*]] = stablehlo.select %{{.*}}, %{{.*}}, %{{.*}} : tensor<3xi1>, tensor<3xf32>
// CHECK:         %[[BF:.*]] = stablehlo.convert %[[W]] : (tensor<3x4x4xf32>) -> tensor<3x4x4xbf16>
// CHECK:         %[[W32:.*]] = stablehlo.convert %[[BF]] : (tensor<3x4x4xbf16>) -> tensor<3x4x4xf32>
// CHECK:         %[[SB:.*]] = stablehlo.broadcast_in_dim %[[S]], dims = [0] : (tensor<3xf32>) -> tensor<3x4x4xf32>
// CHECK:         %[[D:.*]] = stablehlo.divide %[[W32]], %[[SB]] : tensor<3x4x4xf32>
// CHECK:         %[[C:.*]] = stablehlo.clamp %{{.*}}, %[[D]], %{{.*}} : (tensor<f32>, tensor<3x4x4xf32>, tensor<f32>) -> tensor<3x4x4xf32>
// CHECK:         %[[Q:.*]] = stablehlo.convert %[[C]] : (tensor<3x4x4xf32>) -> tensor<3x4x4xf8E4M3FN>
// CHECK:         stablehlo.while(%{{.*}} = %[[X]], %{{.*}} = %[[W]], %{{.*}} = %{{.*}}, %{{.*}} = %[[ROWS]], %[[QS:.*]] = %[[Q]])
// CHECK:         } do {
// CHECK:           %[[PICK:.*]] = stablehlo.dynamic_slice %[[QS]], %[[I:[^,]*]], %{{.*}}, %{{.*}}, sizes = [1, 4, 4] : (tensor<3x4x4xf8E4M3FN>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf8E4M3FN>
// CHECK:           %[[LQ:.*]] = stablehlo.reshape %[[PICK]] : (tensor<1x4x4xf8E4M3FN>) -> tensor<4x4xf8E4M3FN>
// CHECK:           func.call @layer(%{{.*}}, %{{.*}}, %{{.*}}, %[[LQ]])
// CHECK:           stablehlo.return %{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}, %[[QS]]
// CHECK-LABEL: func.func private @layer
// CHECK-SAME:    %[[LW:[^:]*]]: tensor<4x4xf8E4M3FN>) -> tensor<8x4xf32>
// CHECK:         %[[HQ:.*]] = stablehlo.convert %{{.*}} : (tensor<8x4xf32>) -> tensor<8x4xf8E4M3FN>
// CHECK-NOT:     -> tensor<4x4xf8E4M3FN>
// CHECK:         stablehlo.dot_general %[[HQ]], %[[LW]]
func.func public @main(%x: tensor<8x4xf32>, %w: tensor<3x4x4xf32>, %rows: tensor<3xbf16>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:4 = stablehlo.while(%h = %x, %ws = %w, %i = %c0, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<3xbf16>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %wi = func.call @index(%ws, %i) : (tensor<3x4x4xf32>, tensor<i32>) -> tensor<4x4xf32>
    %p = stablehlo.dynamic_slice %rs, %i, sizes = [1] : (tensor<3xbf16>, tensor<i32>) -> tensor<1xbf16>
    %a = stablehlo.reshape %p : (tensor<1xbf16>) -> tensor<bf16>
    %y = func.call @layer(%h, %wi, %a) : (tensor<8x4xf32>, tensor<4x4xf32>, tensor<bf16>) -> tensor<8x4xf32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %y, %ws, %next, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<3xbf16>
  }
  return %r#0 : tensor<8x4xf32>
}
func.func private @index(%stack: tensor<3x4x4xf32>, %i: tensor<i32>) -> tensor<4x4xf32> {
  %c = stablehlo.constant dense<0> : tensor<i32>
  %s = stablehlo.dynamic_slice %stack, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
  %r = stablehlo.reshape %s : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
  return %r : tensor<4x4xf32>
}
func.func private @layer(%h: tensor<8x4xf32>, %w: tensor<4x4xf32>, %a: tensor<bf16>) -> tensor<8x4xf32> {
  %held:2 = stablehlo.optimization_barrier %h, %w : tensor<8x4xf32>, tensor<4x4xf32>
  %bf = stablehlo.convert %held#1 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
  %a32 = stablehlo.convert %a : (tensor<bf16>) -> tensor<f32>
  %k = stablehlo.constant dense<0.00223214296> : tensor<f32>
  %s0 = stablehlo.multiply %a32, %k : tensor<f32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %gt = stablehlo.compare GT, %s0, %zero, FLOAT : (tensor<f32>, tensor<f32>) -> tensor<i1>
  %fin = stablehlo.is_finite %s0 : (tensor<f32>) -> tensor<i1>
  %ok = stablehlo.and %gt, %fin : tensor<i1>
  %one = stablehlo.constant dense<1.000000e+00> : tensor<f32>
  %s = stablehlo.select %ok, %s0, %one : tensor<i1>, tensor<f32>
  %w32 = stablehlo.convert %bf : (tensor<4x4xbf16>) -> tensor<4x4xf32>
  %sb = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
  %d = stablehlo.divide %w32, %sb : tensor<4x4xf32>
  %lo = stablehlo.constant dense<-4.480000e+02> : tensor<f32>
  %hi = stablehlo.constant dense<4.480000e+02> : tensor<f32>
  %c = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
  %q = stablehlo.convert %c : (tensor<4x4xf32>) -> tensor<4x4xf8E4M3FN>
  %hs = stablehlo.broadcast_in_dim %one, dims = [] : (tensor<f32>) -> tensor<8x4xf32>
  %hd = stablehlo.divide %held#0, %hs : tensor<8x4xf32>
  %hc = stablehlo.clamp %lo, %hd, %hi : (tensor<f32>, tensor<8x4xf32>, tensor<f32>) -> tensor<8x4xf32>
  %hq = stablehlo.convert %hc : (tensor<8x4xf32>) -> tensor<8x4xf8E4M3FN>
  %y = stablehlo.dot_general %hq, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E4M3FN>) -> tensor<8x4xf32>
  %yb = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<8x4xf32>
  %out = stablehlo.multiply %y, %yb : tensor<8x4xf32>
  return %out : tensor<8x4xf32>
}

// -----

// A scale that does not change in the loop (delayed scaling's, from the history): the
// stack is divided by that one scale, the slice read in the body directly.
// CHECK-LABEL: func.func public @invariant_scale
// CHECK-SAME:    (%[[X:.*]]: tensor<8x4xf8E4M3FN>, %[[W:.*]]: tensor<3x4x4xf32>, %[[S:.*]]: tensor<f32>)
// CHECK:         %[[SB:.*]] = stablehlo.broadcast_in_dim %[[S]], dims = [] : (tensor<f32>) -> tensor<3x4x4xf32>
// CHECK:         %[[D:.*]] = stablehlo.divide %[[W]], %[[SB]] : tensor<3x4x4xf32>
// CHECK:         %[[Q:.*]] = stablehlo.convert %{{.*}} : (tensor<3x4x4xf32>) -> tensor<3x4x4xf8E5M2>
// CHECK:         stablehlo.while({{.*}}, %[[QS:.*]] = %[[Q]])
// CHECK:         } do {
// CHECK-NOT:       stablehlo.divide
// CHECK:           stablehlo.dynamic_slice %[[QS]]
// CHECK-NOT:       stablehlo.divide
// CHECK:           stablehlo.return
func.func public @invariant_scale(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %s: tensor<f32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:3 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %sb = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %d = stablehlo.divide %wi, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E5M2>) -> tensor<8x4xf32>
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %acc2, %ws, %next : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>
  }
  return %r#0 : tensor<8x4xf32>
}

// -----

// A backward loop (transpose(...) in its name) keeps its quantisations where only its
// own dots read them: a stack held over it would add to the step's memory peak...
// CHECK-LABEL: func.func public @backward_loop
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         } do {
// CHECK:           stablehlo.divide %{{.*}}, %{{.*}} : tensor<4x4xf32>
// CHECK:           stablehlo.convert %{{.*}} : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         return
func.func public @backward_loop(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %s: tensor<f32>, %rows: tensor<3xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:5 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %sc = %s, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %scale = stablehlo.add %sc, %sc : tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %d = stablehlo.divide %wi, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E5M2>) -> tensor<8x4xf32>
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    stablehlo.return %acc2, %ws, %next, %sc, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
  } loc("jit(step)/transpose(jvp())/while")
  return %r#0 : tensor<8x4xf32>
}

// -----

// ...reading the weight's slice itself where it read it through remat's barrier, for
// which XLA would copy the f32 slice; the backward's own dot gets no fence.
// CHECK-LABEL: func.func public @backward_loop_behind_remat_barrier
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         } do {
// CHECK:           %[[W:.*]] = stablehlo.reshape %{{.*}} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
// CHECK:           %[[D:.*]] = stablehlo.divide %[[W]], %{{.*}} : tensor<4x4xf32>
// CHECK:           %[[C:.*]] = stablehlo.clamp %{{.*}}, %[[D]], %{{.*}}
// CHECK:           %[[Q:.*]] = stablehlo.convert %[[C]] : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
// CHECK-NEXT:      stablehlo.dot_general %{{.*}}, %[[Q]]
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         return
func.func public @backward_loop_behind_remat_barrier(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %s: tensor<f32>, %rows: tensor<3xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:5 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %sc = %s, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %scale = stablehlo.add %sc, %sc : tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %kept = stablehlo.optimization_barrier %wi : tensor<4x4xf32>
    %d = stablehlo.divide %kept, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E5M2>) -> tensor<8x4xf32>
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    stablehlo.return %acc2, %ws, %next, %sc, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
  } loc("jit(step)/transpose(jvp())/while")
  return %r#0 : tensor<8x4xf32>
}

// -----

// ...as does remat's recomputed forward, behind a layout fence (reshape to 1-D,
// barrier, reshape back): that dot needs the weight transposed, and XLA:GPU otherwise
// makes it by carrying a transposed f32 copy of the whole stack into the loop. Behind
// the fence it transposes the fp8 slice. Nothing is hoisted: an fp8 stack held over
// the backward loop would cost a byte per weight at the step's memory peak.
// CHECK-LABEL: func.func public @backward_recomputation
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         } do {
// CHECK:           %[[Q:.*]] = stablehlo.convert %{{.*}} : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
// CHECK-NEXT:      %[[FLAT:.*]] = stablehlo.reshape %[[Q]] : (tensor<4x4xf8E5M2>) -> tensor<16xf8E5M2>
// CHECK-NEXT:      %[[KEPT:.*]] = stablehlo.optimization_barrier %[[FLAT]] : tensor<16xf8E5M2>
// CHECK-NEXT:      %[[BACK:.*]] = stablehlo.reshape %[[KEPT]] : (tensor<16xf8E5M2>) -> tensor<4x4xf8E5M2>
// CHECK-NOT:       optimization_barrier
// CHECK:           stablehlo.dot_general %{{.*}}, %[[BACK]]
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         return
func.func public @backward_recomputation(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %s: tensor<f32>, %rows: tensor<3xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:5 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %sc = %s, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %scale = stablehlo.add %sc, %sc : tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %d = stablehlo.divide %wi, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E5M2>) -> tensor<8x4xf32> loc("jit(step)/transpose(jvp())/while/body/checkpoint/rematted_computation/dot_general")
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    stablehlo.return %acc2, %ws, %next, %sc, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
  } loc("jit(step)/transpose(jvp())/while")
  return %r#0 : tensor<8x4xf32>
}

// -----

// jax 0.11 recomputes in the loop body, the weight slice read through remat's
// optimization_barrier, for which XLA copies the f32 slice: the fenced quantisation
// reads the slice itself.
// CHECK-LABEL: func.func public @recomputation_behind_remat_barrier
// CHECK:         } do {
// CHECK:           %[[W:.*]] = stablehlo.reshape %{{.*}} : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
// CHECK:           %[[D:.*]] = stablehlo.divide %[[W]], %{{.*}} : tensor<4x4xf32>
// CHECK:           %[[C:.*]] = stablehlo.clamp %{{.*}}, %[[D]], %{{.*}}
// CHECK:           %[[Q:.*]] = stablehlo.convert %[[C]] : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
// CHECK-NEXT:      %[[FLAT:.*]] = stablehlo.reshape %[[Q]] : (tensor<4x4xf8E5M2>) -> tensor<16xf8E5M2>
// CHECK-NEXT:      %[[KEPT:.*]] = stablehlo.optimization_barrier %[[FLAT]] : tensor<16xf8E5M2>
// CHECK-NEXT:      %[[BACK:.*]] = stablehlo.reshape %[[KEPT]] : (tensor<16xf8E5M2>) -> tensor<4x4xf8E5M2>
// CHECK:           stablehlo.dot_general %{{.*}}, %[[BACK]]
// CHECK:         return
func.func public @recomputation_behind_remat_barrier(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %s: tensor<f32>, %rows: tensor<3xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:5 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %sc = %s, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %scale = stablehlo.add %sc, %sc : tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %kept = stablehlo.optimization_barrier %wi : tensor<4x4xf32>
    %d = stablehlo.divide %kept, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E5M2>) -> tensor<8x4xf32> loc("jit(step)/transpose(jvp())/while/body/checkpoint/rematted_computation/dot_general")
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    stablehlo.return %acc2, %ws, %next, %sc, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
  } loc("jit(step)/transpose(jvp())/while")
  return %r#0 : tensor<8x4xf32>
}

// -----

// A recomputed dot that contracts the quantised slice's last dimension reads it as
// Hopper's fp8 GEMM wants it (K-major): no fence.
// CHECK-LABEL: func.func public @recomputation_reads_k_major
// CHECK-NOT:     optimization_barrier
// CHECK:         return
func.func public @recomputation_reads_k_major(%x: tensor<4x8xf8E4M3FN>, %w: tensor<3x4x4xf32>, %s: tensor<f32>, %rows: tensor<3xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:5 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %sc = %s, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %scale = stablehlo.add %sc, %sc : tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %d = stablehlo.divide %wi, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %yt = stablehlo.dot_general %q, %x, contracting_dims = [1] x [0] : (tensor<4x4xf8E5M2>, tensor<4x8xf8E4M3FN>) -> tensor<4x8xf32>
    %y = stablehlo.transpose %yt, dims = [1, 0] : (tensor<4x8xf32>) -> tensor<8x4xf32> loc("jit(step)/transpose(jvp())/while/body/checkpoint/rematted_computation/dot_general")
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    stablehlo.return %acc2, %ws, %next, %sc, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
  } loc("jit(step)/transpose(jvp())/while")
  return %r#0 : tensor<8x4xf32>
}

// -----

// A scale the body changes (a carry it updates) is not the same for every layer.
// CHECK-LABEL: func.func public @changing_scale
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         } do {
// CHECK:           stablehlo.divide %{{.*}}, %{{.*}} : tensor<4x4xf32>
// CHECK:           stablehlo.convert %{{.*}} : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         return
func.func public @changing_scale(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %s: tensor<f32>, %rows: tensor<3xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:5 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %sc = %s, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %scale = stablehlo.add %sc, %sc : tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %d = stablehlo.divide %wi, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E5M2>) -> tensor<8x4xf32>
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    stablehlo.return %acc2, %ws, %next, %scale, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
  }
  return %r#0 : tensor<8x4xf32>
}

// -----

// A scale picked from the rows at another position than the slice's (i + 1, which
// dynamic_slice clamps to the last row): each layer's scale is gathered from the rows
// at positions 1, 2, 3 (gather clamps alike).
// CHECK-LABEL: func.func public @other_layer
// CHECK-SAME:    %[[ROWS:[^:]*]]: tensor<3xf32>)
// CHECK:         %[[IOTA:.*]] = stablehlo.iota dim = 0 : tensor<3xi32>
// CHECK:         %[[ONE:.*]] = stablehlo.constant dense<1> : tensor<3xi32>
// CHECK:         %[[AT:.*]] = stablehlo.add %[[IOTA]], %[[ONE]] : tensor<3xi32>
// CHECK:         %[[AT2:.*]] = stablehlo.reshape %[[AT]] : (tensor<3xi32>) -> tensor<3x1xi32>
// CHECK:         %[[S:.*]] = "stablehlo.gather"(%[[ROWS]], %[[AT2]])
// CHECK-SAME:      collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1
// CHECK-SAME:      slice_sizes = array<i64: 1>
// CHECK:         stablehlo.broadcast_in_dim %[[S]], dims = [0] : (tensor<3xf32>) -> tensor<3x4x4xf32>
// CHECK:         stablehlo.convert %{{.*}} : (tensor<3x4x4xf32>) -> tensor<3x4x4xf8E5M2>
// CHECK:         } do {
// CHECK-NOT:       stablehlo.divide
// CHECK:         return
func.func public @other_layer(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %s: tensor<f32>, %rows: tensor<3xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:5 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %sc = %s, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %p = stablehlo.dynamic_slice %rs, %next, sizes = [1] : (tensor<3xf32>, tensor<i32>) -> tensor<1xf32>
    %scale = stablehlo.reshape %p : (tensor<1xf32>) -> tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %d = stablehlo.divide %wi, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E5M2>) -> tensor<8x4xf32>
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    stablehlo.return %acc2, %ws, %next, %sc, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
  }
  return %r#0 : tensor<8x4xf32>
}

// -----

// A loop whose results carry shardings (Shardy's attribute) keeps its carries.
// CHECK-LABEL: func.func public @sharded_loop
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         } do {
// CHECK:           stablehlo.divide %{{.*}}, %{{.*}} : tensor<4x4xf32>
// CHECK:           stablehlo.convert %{{.*}} : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
// CHECK-NOT:     tensor<3x4x4xf8E5M2>
// CHECK:         return
sdy.mesh @mesh = <["x"=2]>
func.func public @sharded_loop(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %s: tensor<f32>, %rows: tensor<3xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:5 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %sc = %s, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
   attributes {sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{}, {}]>, <@mesh, [{}, {"x"}, {}]>, <@mesh, []>, <@mesh, []>, <@mesh, [{}]>]>}
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %scale = stablehlo.add %sc, %sc : tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %d = stablehlo.divide %wi, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E5M2>) -> tensor<8x4xf32>
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    stablehlo.return %acc2, %ws, %next, %sc, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<f32>, tensor<3xf32>
  }
  return %r#0 : tensor<8x4xf32>
}

// -----

// A weight outside any loop: its quantisation stays in the function (were it lifted to
// main, a remat'd function would keep the fp8 copy alive for the backward pass).
// CHECK-LABEL: func.func public @no_loop
// CHECK-NOT:     tensor<4x4xf8E4M3FN>
// CHECK:         call @dense(
// CHECK-SAME:    -> tensor<8x4xf32>
// CHECK-LABEL: func.func private @dense
// CHECK-SAME:    tensor<bf16>) -> tensor<8x4xf32>
// CHECK:         stablehlo.convert %{{.*}} : (tensor<4x4xf32>) -> tensor<4x4xf8E4M3FN>
func.func public @no_loop(%x: tensor<8x4xf8E4M3FN>, %w: tensor<4x4xf32>, %a: tensor<bf16>) -> tensor<8x4xf32> {
  %y = func.call @dense(%x, %w, %a) : (tensor<8x4xf8E4M3FN>, tensor<4x4xf32>, tensor<bf16>) -> tensor<8x4xf32>
  return %y : tensor<8x4xf32>
}
func.func private @dense(%x: tensor<8x4xf8E4M3FN>, %w: tensor<4x4xf32>, %a: tensor<bf16>) -> tensor<8x4xf32> {
  %s = stablehlo.convert %a : (tensor<bf16>) -> tensor<f32>
  %sb = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
  %d = stablehlo.divide %w, %sb : tensor<4x4xf32>
  %lo = stablehlo.constant dense<-4.480000e+02> : tensor<f32>
  %hi = stablehlo.constant dense<4.480000e+02> : tensor<f32>
  %c = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
  %q = stablehlo.convert %c : (tensor<4x4xf32>) -> tensor<4x4xf8E4M3FN>
  %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E4M3FN>) -> tensor<8x4xf32>
  return %y : tensor<8x4xf32>
}

// -----

// The layer's element computed on before its reshape to a scalar (one-element vectors):
// on the whole rows, the one-element constant broadcast along them.
// CHECK-LABEL: func.func public @element_vector
// CHECK-SAME:    %[[ROWS:[^:]*]]: tensor<3xf32>)
// CHECK:         %[[TWO:.*]] = stablehlo.broadcast_in_dim %{{.*}}, dims = [0] : (tensor<1xf32>) -> tensor<3xf32>
// CHECK:         %[[S:.*]] = stablehlo.multiply %[[ROWS]], %[[TWO]] : tensor<3xf32>
// CHECK:         stablehlo.broadcast_in_dim %[[S]], dims = [0] : (tensor<3xf32>) -> tensor<3x4x4xf32>
// CHECK:         stablehlo.convert %{{.*}} : (tensor<3x4x4xf32>) -> tensor<3x4x4xf8E5M2>
// CHECK:         } do {
// CHECK-NOT:       stablehlo.divide
// CHECK:           stablehlo.return
func.func public @element_vector(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %rows: tensor<3xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:4 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %rs = %rows) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<3xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %p = stablehlo.dynamic_slice %rs, %i, sizes = [1] : (tensor<3xf32>, tensor<i32>) -> tensor<1xf32>
    %two = stablehlo.constant dense<2.000000e+00> : tensor<1xf32>
    %p2 = stablehlo.multiply %p, %two : tensor<1xf32>
    %scale = stablehlo.reshape %p2 : (tensor<1xf32>) -> tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %d = stablehlo.divide %wi, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-5.734400e+04> : tensor<f32>
    %hi = stablehlo.constant dense<5.734400e+04> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E5M2>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E5M2>) -> tensor<8x4xf32>
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %acc2, %ws, %next, %rs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<3xf32>
  }
  return %r#0 : tensor<8x4xf32>
}

// SCAN-LABEL: func.func public @main
// SCAN:         %[[Q:.*]] = stablehlo.convert %{{.*}} : (tensor<2x32x32xf32>) -> tensor<2x32x32xf8E4M3FN>
// SCAN:         stablehlo.while({{.*}}, %[[QS:.*]] = %[[Q]])
// SCAN:         } do {
// SCAN-NOT:       stablehlo.select
// SCAN:           %[[PICK:.*]] = stablehlo.dynamic_slice %[[QS]], {{.*}} -> tensor<1x32x32xf8E4M3FN>
// SCAN:           %[[LQ:.*]] = stablehlo.reshape %[[PICK]]
// SCAN:           func.call @closed_call({{.*}}, %[[LQ]])
// SCAN:         stablehlo.while
// SCAN-LABEL: func.func private @closed_call(
// SCAN-SAME:    %[[W:[^:]*]]: tensor<32x32xf8E4M3FN>)
// SCAN-NOT:     -> tensor<32x32xf8E4M3FN>
// SCAN:         stablehlo.dot_general %{{.*}}, %[[W]]
// NOTE: hoist-quantize: 1 fp8 quantisation(s) of a scanned tensor's slice done for every slice before the loop, not in its body

// -----

// Delayed scaling's column per layer: the scale is the history maximum at column
// 2 + i (fp8_state.py). Layer i's scale is element i of the slice [2, 5) of it.
// CHECK-LABEL: func.func public @delayed_columns
// CHECK-SAME:    %[[H:[^:]*]]: tensor<8xf32>)
// CHECK:         %[[PAST:.*]] = stablehlo.slice %[[H]] [2:5] : (tensor<8xf32>) -> tensor<3xf32>
// CHECK:         stablehlo.multiply %[[PAST]], %{{.*}} : tensor<3xf32>
// CHECK:         stablehlo.convert %{{.*}} : (tensor<3x4x4xf32>) -> tensor<3x4x4xf8E4M3FN>
// CHECK:         } do {
// CHECK-NOT:       stablehlo.divide
// CHECK:         return
func.func public @delayed_columns(%x: tensor<8x4xf8E4M3FN>, %w: tensor<3x4x4xf32>, %hist: tensor<8xf32>) -> tensor<8x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32>
  %r:4 = stablehlo.while(%acc = %z, %ws = %w, %i = %c0, %hs = %hist) : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<8xf32>
   cond {
    %n = stablehlo.constant dense<3> : tensor<i32>
    %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %lt : tensor<i1>
  } do {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %two = stablehlo.constant dense<2> : tensor<i32>
    %at = stablehlo.add %i, %two : tensor<i32>
    %ds = stablehlo.dynamic_slice %ws, %i, %c, %c, sizes = [1, 4, 4] : (tensor<3x4x4xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x4x4xf32>
    %wi = stablehlo.reshape %ds : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %p = stablehlo.dynamic_slice %hs, %at, sizes = [1] : (tensor<8xf32>, tensor<i32>) -> tensor<1xf32>
    %past = stablehlo.reshape %p : (tensor<1xf32>) -> tensor<f32>
    %k = stablehlo.constant dense<0.00223214296> : tensor<f32>
    %scale = stablehlo.multiply %past, %k : tensor<f32>
    %sb = stablehlo.broadcast_in_dim %scale, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %d = stablehlo.divide %wi, %sb : tensor<4x4xf32>
    %lo = stablehlo.constant dense<-4.480000e+02> : tensor<f32>
    %hi = stablehlo.constant dense<4.480000e+02> : tensor<f32>
    %cl = stablehlo.clamp %lo, %d, %hi : (tensor<f32>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %q = stablehlo.convert %cl : (tensor<4x4xf32>) -> tensor<4x4xf8E4M3FN>
    %y = stablehlo.dot_general %x, %q, contracting_dims = [1] x [0] : (tensor<8x4xf8E4M3FN>, tensor<4x4xf8E4M3FN>) -> tensor<8x4xf32>
    %acc2 = stablehlo.add %acc, %y : tensor<8x4xf32>
    %one = stablehlo.constant dense<1> : tensor<i32>
    %next = stablehlo.add %i, %one : tensor<i32>
    stablehlo.return %acc2, %ws, %next, %hs : tensor<8x4xf32>, tensor<3x4x4xf32>, tensor<i32>, tensor<8xf32>
  }
  return %r#0 : tensor<8x4xf32>
}
