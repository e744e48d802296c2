// The policy below exercises every kind of rule at once; each function's locations pick
// the rule it tests. Scope rules: head=float32, Block_*/attn=keep (glob), frozen=keep,
// lora=compute. Op rules: the bf16 preset (every op kind computes in bf16).
//
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts \
// RUN:   --policy 'bf16,scope:head=float32,scope:Block_*/attn=keep,scope:frozen=keep,scope:lora=compute' \
// RUN:   | filecheck %s --enable-var-scope
//
// Idempotence: the pass run on its own (located) output changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --debug-info --pass hlo-amp-insert-converts \
// RUN:   --policy 'bf16,scope:head=float32,scope:Block_*/attn=keep,scope:frozen=keep,scope:lora=compute' \
// RUN:   | hlo-amp-opt --split-input-file --pass hlo-amp-insert-converts \
// RUN:   --policy 'bf16,scope:head=float32,scope:Block_*/attn=keep,scope:frozen=keep,scope:lora=compute' \
// RUN:   | filecheck %s --enable-var-scope
//
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts --policy f16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=F16
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts --policy 'bf16,f64=true' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=F64
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts --policy 'bf16,backward=keep' \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=BWD
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-insert-converts --op dot_general=float16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=OPF16

// A dot_general computes with bf16 operands and keeps its f32 result (f32 accumulation).
// CHECK-LABEL: func.func @dot_f32
// CHECK-SAME:    (%[[A:.*]]: tensor<2x4xf32>, %[[B:.*]]: tensor<4x3xf32>)
// CHECK:         %[[A16:.*]] = stablehlo.convert %[[A]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[B16:.*]] = stablehlo.convert %[[B]] : (tensor<4x3xf32>) -> tensor<4x3xbf16>
// CHECK:         %[[R:.*]] = stablehlo.dot_general %[[A16]], %[[B16]], contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x3xbf16>) -> tensor<2x3xf32>
// CHECK:         return %[[R]] : tensor<2x3xf32>
// F16-LABEL:   func.func @dot_f32
// F16:           %[[A16:.*]] = stablehlo.convert %{{.*}} : (tensor<2x4xf32>) -> tensor<2x4xf16>
// F16:           %[[B16:.*]] = stablehlo.convert %{{.*}} : (tensor<4x3xf32>) -> tensor<4x3xf16>
// F16:           stablehlo.dot_general %[[A16]], %[[B16]], {{.*}} : (tensor<2x4xf16>, tensor<4x3xf16>) -> tensor<2x3xf32>
// F16-NOT:       stablehlo.convert
// F16:           return
// OPF16-LABEL: func.func @dot_f32
// OPF16:         %[[A16:.*]] = stablehlo.convert %{{.*}} : (tensor<2x4xf32>) -> tensor<2x4xf16>
// OPF16:         %[[B16:.*]] = stablehlo.convert %{{.*}} : (tensor<4x3xf32>) -> tensor<4x3xf16>
// OPF16:         %[[R16:.*]] = stablehlo.dot_general %[[A16]], %[[B16]], {{.*}} : (tensor<2x4xf16>, tensor<4x3xf16>) -> tensor<2x3xf16>
// OPF16:         %[[R:.*]] = stablehlo.convert %[[R16]] : (tensor<2x3xf16>) -> tensor<2x3xf32>
// OPF16:         return %[[R]] : tensor<2x3xf32>
func.func @dot_f32(%a: tensor<2x4xf32>, %b: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %0 : tensor<2x3xf32>
}

// -----

// A convolution: bf16 operands, f32 result.
// CHECK-LABEL: func.func @conv_f32
// CHECK-SAME:    (%[[X:.*]]: tensor<1x5x5x2xf32>, %[[K:.*]]: tensor<3x3x2x4xf32>)
// CHECK:         %[[X16:.*]] = stablehlo.convert %[[X]] : (tensor<1x5x5x2xf32>) -> tensor<1x5x5x2xbf16>
// CHECK:         %[[K16:.*]] = stablehlo.convert %[[K]] : (tensor<3x3x2x4xf32>) -> tensor<3x3x2x4xbf16>
// CHECK:         %[[R:.*]] = stablehlo.convolution(%[[X16]], %[[K16]])
// CHECK-SAME:      : (tensor<1x5x5x2xbf16>, tensor<3x3x2x4xbf16>) -> tensor<1x3x3x4xf32>
// CHECK:         return %[[R]] : tensor<1x3x3x4xf32>
// F16-LABEL:   func.func @conv_f32
// F16:           stablehlo.convolution
// F16-SAME:        : (tensor<1x5x5x2xf16>, tensor<3x3x2x4xf16>) -> tensor<1x3x3x4xf32>
// An op rule names one op kind: --op dot_general=float16 leaves convolutions on bf16.
// OPF16-LABEL: func.func @conv_f32
// OPF16:         stablehlo.convolution
// OPF16-SAME:      : (tensor<1x5x5x2xbf16>, tensor<3x3x2x4xbf16>) -> tensor<1x3x3x4xf32>
func.func @conv_f32(%x: tensor<1x5x5x2xf32>, %k: tensor<3x3x2x4xf32>) -> tensor<1x3x3x4xf32> {
  %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x5x5x2xf32>, tensor<3x3x2x4xf32>) -> tensor<1x3x3x4xf32> loc("jit(f)/conv1/conv_general_dilated")
  return %0 : tensor<1x3x3x4xf32>
}

// -----

// stablehlo.dot (no location at all) is a candidate too; it has its own op kind.
// CHECK-LABEL: func.func @dot_plain
// CHECK:         %[[A16:.*]] = stablehlo.convert %{{.*}} : (tensor<4xf32>) -> tensor<4xbf16>
// CHECK:         %[[B16:.*]] = stablehlo.convert %{{.*}} : (tensor<4x3xf32>) -> tensor<4x3xbf16>
// CHECK:         stablehlo.dot %[[A16]], %[[B16]] : (tensor<4xbf16>, tensor<4x3xbf16>) -> tensor<3xf32>
// OPF16-LABEL: func.func @dot_plain
// OPF16:         stablehlo.dot %{{.*}}, %{{.*}} : (tensor<4xbf16>, tensor<4x3xbf16>) -> tensor<3xf32>
func.func @dot_plain(%a: tensor<4xf32>, %b: tensor<4x3xf32>) -> tensor<3xf32> {
  %0 = stablehlo.dot %a, %b : (tensor<4xf32>, tensor<4x3xf32>) -> tensor<3xf32>
  return %0 : tensor<3xf32>
}

// -----

// Integer dots are never touched, whatever the action.
// CHECK-LABEL: func.func @int_dot
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xi8>, tensor<4x3xi8>) -> tensor<2x3xi32>
// OPF16-LABEL: func.func @int_dot
// OPF16-NOT:     stablehlo.convert
// OPF16:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xi8>, tensor<4x3xi8>) -> tensor<2x3xi32>
func.func @int_dot(%a: tensor<2x4xi8>, %b: tensor<4x3xi8>) -> tensor<2x3xi32> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x4xi8>, tensor<4x3xi8>) -> tensor<2x3xi32>
  return %0 : tensor<2x3xi32>
}

// -----

// Complex dots are never touched.
// CHECK-LABEL: func.func @complex_dot
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} -> tensor<2x3xcomplex<f32>>
// OPF16-LABEL: func.func @complex_dot
// OPF16-NOT:     stablehlo.convert
// OPF16:         stablehlo.dot_general %arg0, %arg1, {{.*}} -> tensor<2x3xcomplex<f32>>
func.func @complex_dot(%a: tensor<2x4xcomplex<f32>>, %b: tensor<4x3xcomplex<f32>>) -> tensor<2x3xcomplex<f32>> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x4xcomplex<f32>>, tensor<4x3xcomplex<f32>>) -> tensor<2x3xcomplex<f32>>
  return %0 : tensor<2x3xcomplex<f32>>
}

// -----

// A complex convolution as jax lowers it (Gauss's trick: three real convolutions of the
// parts, their results subtracted): left as written, as a complex op is. A convolution
// of a part and a real weight is a real op, and computes in bf16.
// CHECK-LABEL: func.func @complex_conv_parts
// CHECK-NOT:     stablehlo.convert {{.*}}xbf16>
// CHECK:         %[[K1:.*]] = stablehlo.convolution(%{{.*}}, %{{.*}}) {{.*}} : (tensor<1x2x4xf32>, tensor<2x2x1xf32>)
// CHECK:         stablehlo.convolution({{.*}}) {{.*}} : (tensor<1x2x4xf32>, tensor<2x2x1xf32>)
// CHECK:         stablehlo.convolution({{.*}}) {{.*}} : (tensor<1x2x4xf32>, tensor<2x2x1xf32>)
// CHECK:         stablehlo.convolution({{.*}}) {{.*}} : (tensor<1x2x4xbf16>, tensor<2x2x1xbf16>)
func.func @complex_conv_parts(%x: tensor<1x2x4xcomplex<f32>>, %y: tensor<2x2x1xcomplex<f32>>, %w: tensor<2x2x1xf32>) -> (tensor<1x2x4xcomplex<f32>>, tensor<1x2x4xf32>) {
  %xr = stablehlo.real %x : (tensor<1x2x4xcomplex<f32>>) -> tensor<1x2x4xf32>
  %xi = stablehlo.imag %x : (tensor<1x2x4xcomplex<f32>>) -> tensor<1x2x4xf32>
  %yr = stablehlo.real %y : (tensor<2x2x1xcomplex<f32>>) -> tensor<2x2x1xf32>
  %yi = stablehlo.imag %y : (tensor<2x2x1xcomplex<f32>>) -> tensor<2x2x1xf32>
  %s = stablehlo.add %xr, %xi : tensor<1x2x4xf32>
  %k1 = stablehlo.convolution(%s, %yr) dim_numbers = [b, f, 0]x[o, i, 0]->[b, f, 0], window = {stride = [1], pad = [[0, 0]], lhs_dilate = [1], rhs_dilate = [1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x2x4xf32>, tensor<2x2x1xf32>) -> tensor<1x2x4xf32>
  %d = stablehlo.subtract %yi, %yr : tensor<2x2x1xf32>
  %k2 = stablehlo.convolution(%xr, %d) dim_numbers = [b, f, 0]x[o, i, 0]->[b, f, 0], window = {stride = [1], pad = [[0, 0]], lhs_dilate = [1], rhs_dilate = [1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x2x4xf32>, tensor<2x2x1xf32>) -> tensor<1x2x4xf32>
  %e = stablehlo.add %yr, %yi : tensor<2x2x1xf32>
  %k3 = stablehlo.convolution(%xi, %e) dim_numbers = [b, f, 0]x[o, i, 0]->[b, f, 0], window = {stride = [1], pad = [[0, 0]], lhs_dilate = [1], rhs_dilate = [1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x2x4xf32>, tensor<2x2x1xf32>) -> tensor<1x2x4xf32>
  %re = stablehlo.subtract %k1, %k3 : tensor<1x2x4xf32>
  %im = stablehlo.add %k1, %k2 : tensor<1x2x4xf32>
  %c = stablehlo.complex %re, %im : tensor<1x2x4xcomplex<f32>>
  %real = stablehlo.convolution(%xr, %w) dim_numbers = [b, f, 0]x[o, i, 0]->[b, f, 0], window = {stride = [1], pad = [[0, 0]], lhs_dilate = [1], rhs_dilate = [1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x2x4xf32>, tensor<2x2x1xf32>) -> tensor<1x2x4xf32>
  return %c, %real : tensor<1x2x4xcomplex<f32>>, tensor<1x2x4xf32>
}

// -----

// Already bf16: nothing to do under "compute", nor under a 16-bit dtype (f16 operands
// and result overflowed where bf16 accumulating to f32 did not: docs/policies.md).
// CHECK-LABEL: func.func @bf16_dot
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xbf16>, tensor<4x3xbf16>) -> tensor<2x3xf32>
// F16-LABEL:   func.func @bf16_dot
// F16-NOT:       stablehlo.convert
// F16:           stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xbf16>, tensor<4x3xbf16>) -> tensor<2x3xf32>
// OPF16-LABEL: func.func @bf16_dot
// OPF16-NOT:     stablehlo.convert
// OPF16:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xbf16>, tensor<4x3xbf16>) -> tensor<2x3xf32>
func.func @bf16_dot(%a: tensor<2x4xbf16>, %b: tensor<4x3xbf16>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x3xbf16>) -> tensor<2x3xf32>
  return %0 : tensor<2x3xf32>
}

// -----

// f64 is converted only when the policy says f64=true.
// CHECK-LABEL: func.func @f64_dot
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf64>, tensor<4x3xf64>) -> tensor<2x3xf64>
// F64-LABEL:   func.func @f64_dot
// F64:           %[[A16:.*]] = stablehlo.convert %arg0 : (tensor<2x4xf64>) -> tensor<2x4xbf16>
// F64:           %[[B16:.*]] = stablehlo.convert %arg1 : (tensor<4x3xf64>) -> tensor<4x3xbf16>
// F64:           stablehlo.dot_general %[[A16]], %[[B16]], {{.*}} : (tensor<2x4xbf16>, tensor<4x3xbf16>) -> tensor<2x3xf64>
func.func @f64_dot(%a: tensor<2x4xf64>, %b: tensor<4x3xf64>) -> tensor<2x3xf64> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x4xf64>, tensor<4x3xf64>) -> tensor<2x3xf64>
  return %0 : tensor<2x3xf64>
}

// -----

// Only the operand wider than the compute dtype is converted.
// CHECK-LABEL: func.func @mixed_dot
// CHECK-NOT:     stablehlo.convert %arg0
// CHECK:         %[[B16:.*]] = stablehlo.convert %arg1 : (tensor<4x3xf32>) -> tensor<4x3xbf16>
// CHECK:         stablehlo.dot_general %arg0, %[[B16]], {{.*}} : (tensor<2x4xbf16>, tensor<4x3xbf16>) -> tensor<2x3xf32>
func.func @mixed_dot(%a: tensor<2x4xbf16>, %b: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x3xf32>) -> tensor<2x3xf32>
  return %0 : tensor<2x3xf32>
}

// -----

// A weight used by two dots is converted once.
// CHECK-LABEL: func.func @shared_weight
// CHECK-SAME:    (%[[X:[^:]*]]: tensor<2x4xf32>, %[[Y:[^:]*]]: tensor<2x4xf32>, %[[W:[^:]*]]: tensor<4x4xf32>)
// CHECK:         %[[X16:.*]] = stablehlo.convert %[[X]]
// CHECK:         %[[W16:.*]] = stablehlo.convert %[[W]]
// CHECK:         stablehlo.dot_general %[[X16]], %[[W16]],
// CHECK:         %[[Y16:.*]] = stablehlo.convert %[[Y]]
// CHECK-NOT:     stablehlo.convert %[[W]]
// CHECK:         stablehlo.dot_general %[[Y16]], %[[W16]],
func.func @shared_weight(%x: tensor<2x4xf32>, %y: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/q/dot_general")
  %1 = stablehlo.dot_general %y, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/k/dot_general")
  return %0, %1 : tensor<2x4xf32>, tensor<2x4xf32>
}

// -----

// "Block_*/attn" (a glob over two whole segments) matches Block_0/attn/query: kept.
// CHECK-LABEL: func.func @scope_glob
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} -> tensor<2x4xf32>
// A scope excluded by one policy is converted by the plain preset.
// F16-LABEL:   func.func @scope_glob
// F16:           stablehlo.convert
func.func @scope_glob(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/jvp(Block_0)/attn/query/dot_general")
  return %0 : tensor<2x4xf32>
}

// -----

// Segments match whole: "attn" does not match "attn_norm", so the op rule applies.
// CHECK-LABEL: func.func @whole_segments
// CHECK:         stablehlo.convert %arg0
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
func.func @whole_segments(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/jvp(Block_0)/attn_norm/dot_general")
  return %0 : tensor<2x4xf32>
}

// -----

// Backward ops (inside transpose(jvp(...))) follow their forward scope's rule...
// CHECK-LABEL: func.func @backward_follows_scope
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} -> tensor<2x4xf32>
func.func @backward_follows_scope(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/transpose(jvp(Block_1))/attn/dot_general")
  return %0 : tensor<2x4xf32>
}

// -----

// ...unless the policy sets backward=: then forward converts, backward keeps.
// CHECK-LABEL: func.func @backward_option
// CHECK-COUNT-2: stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
// BWD-LABEL:   func.func @backward_option
// BWD:           %[[X16:.*]] = stablehlo.convert %arg0
// BWD:           %[[W16:.*]] = stablehlo.convert %arg1
// BWD:           stablehlo.dot_general %[[X16]], %[[W16]], {{.*}} -> tensor<2x4xf32>
// BWD-NOT:       stablehlo.convert
// BWD:           stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
func.func @backward_option(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/jvp(mlp)/dot_general")
  %1 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/transpose(jvp(mlp))/dot_general")
  return %0, %1 : tensor<2x4xf32>, tensor<2x4xf32>
}

// -----

// The outermost matching scope wins: frozen/lora is kept, lora/frozen computes.
// CHECK-LABEL: func.func @outermost_wins
// CHECK-NOT:     stablehlo.convert
// CHECK:         %[[KEPT:.*]] = stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg0
// CHECK:         %[[W16:.*]] = stablehlo.convert %arg1
// CHECK:         %[[LOW:.*]] = stablehlo.dot_general %[[X16]], %[[W16]], {{.*}} -> tensor<2x4xf32>
// CHECK:         return %[[KEPT]], %[[LOW]]
func.func @outermost_wins(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/frozen/lora/dot_general")
  %1 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/lora/frozen/dot_general")
  return %0, %1 : tensor<2x4xf32>, tensor<2x4xf32>
}

// -----

// amp_stop keeps its inside, unless a rule matching inside it names the op (lora);
// a rule matching outside it (lora/amp_stop) does not reach in.
// CHECK-LABEL: func.func @amp_stop
// CHECK-NOT:     stablehlo.convert
// CHECK:         %[[STOPPED:.*]] = stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>)
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg0
// CHECK:         %[[W16:.*]] = stablehlo.convert %arg1
// CHECK:         %[[NAMED:.*]] = stablehlo.dot_general %[[X16]], %[[W16]], {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>)
// CHECK-NOT:     stablehlo.convert
// CHECK:         %[[OUTSIDE:.*]] = stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>)
// CHECK:         return %[[STOPPED]], %[[NAMED]], %[[OUTSIDE]]
// The plain f16 preset has no lora rule: amp_stop keeps all three.
// F16-LABEL:   func.func @amp_stop
// F16-NOT:       stablehlo.convert
// F16:           return
func.func @amp_stop(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/amp_stop/dot_general")
  %1 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/amp_stop/lora/dot_general")
  %2 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/lora/amp_stop/dot_general")
  return %0, %1, %2 : tensor<2x4xf32>, tensor<2x4xf32>, tensor<2x4xf32>
}

// -----

// A dtype action on a bf16 dot: operands and result upcast to f32, result converted
// back so consumers still see bf16.
// CHECK-LABEL: func.func @scope_float32_upcasts
// CHECK:         %[[A32:.*]] = stablehlo.convert %arg0 : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         %[[B32:.*]] = stablehlo.convert %arg1 : (tensor<4x3xbf16>) -> tensor<4x3xf32>
// CHECK:         %[[R32:.*]] = stablehlo.dot_general %[[A32]], %[[B32]], {{.*}} : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>
// CHECK:         %[[R:.*]] = stablehlo.convert %[[R32]] : (tensor<2x3xf32>) -> tensor<2x3xbf16>
// CHECK:         %[[T:.*]] = stablehlo.tanh %[[R]] : tensor<2x3xbf16>
// CHECK:         return %[[T]] : tensor<2x3xbf16>
func.func @scope_float32_upcasts(%a: tensor<2x4xbf16>, %b: tensor<4x3xbf16>) -> tensor<2x3xbf16> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x4xbf16>, tensor<4x3xbf16>) -> tensor<2x3xbf16> loc("jit(f)/jvp(head)/dot_general")
  %1 = stablehlo.tanh %0 : tensor<2x3xbf16>
  return %1 : tensor<2x3xbf16>
}

// -----

// The same float32 rule on an f32 dot has nothing to do; the scope rule beats the
// bf16 op rule, so the dot is not converted either.
// CHECK-LABEL: func.func @scope_beats_op_rule
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>
func.func @scope_beats_op_rule(%a: tensor<2x4xf32>, %b: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/transpose(jvp(head))/dot_general")
  return %0 : tensor<2x3xf32>
}

// -----

// Ops inside a while body are rewritten in place, in the body's block.
// CHECK-LABEL: func.func @in_while
// CHECK:         stablehlo.while
// CHECK:         cond {
// CHECK-NOT:     stablehlo.convert
// CHECK:         } do {
// CHECK:           %[[H16:.*]] = stablehlo.convert %iterArg_0 : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:           %[[W16:.*]] = stablehlo.convert %arg1 : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:           %[[D:.*]] = stablehlo.dot_general %[[H16]], %[[W16]], {{.*}} -> tensor<2x4xf32>
// CHECK:           stablehlo.return %{{.*}}, %[[D]] : tensor<i32>, tensor<2x4xf32>
func.func @in_while(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:2 = stablehlo.while(%i = %c0, %h = %x) : tensor<i32>, tensor<2x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32>
    %p = stablehlo.compare LT, %i, %c3 : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %d = stablehlo.dot_general %h, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/while/body/cell/dot_general")
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %j = stablehlo.add %i, %c1 : tensor<i32>
    stablehlo.return %j, %d : tensor<i32>, tensor<2x4xf32>
  }
  return %r#1 : tensor<2x4xf32>
}

// -----

// Ops inside case branches: the branch under "head" keeps f32, the other computes.
// CHECK-LABEL: func.func @in_case
// CHECK:         "stablehlo.case"
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg1, %arg2, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>)
// CHECK:         }, {
// CHECK:           %[[X16:.*]] = stablehlo.convert %arg1
// CHECK:           %[[W16:.*]] = stablehlo.convert %arg2
// CHECK:           stablehlo.dot_general %[[X16]], %[[W16]], {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>)
func.func @in_case(%p: tensor<i32>, %x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %r = "stablehlo.case"(%p) ({
    %d = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/cond/branch_0_fun/head/dot_general")
    stablehlo.return %d : tensor<2x4xf32>
  }, {
    %d = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/cond/branch_1_fun/dot_general")
    stablehlo.return %d : tensor<2x4xf32>
  }) : (tensor<i32>) -> tensor<2x4xf32>
  return %r : tensor<2x4xf32>
}

// -----

// A private function called from several scopes is specialised per scope, so that each
// call's ops are reported under its own scope: the "head" call gets a clone @inner_amp0
// kept in f32, "dec" a clone @inner_amp1 in bf16 as "enc"'s @inner.
// CHECK-LABEL: func.func @calls_from_two_scopes
// CHECK:         %[[E:.*]] = call @inner(%arg0, %arg1)
// CHECK:         %[[H:.*]] = call @inner_amp0(%[[E]], %arg1)
// CHECK:         call @inner_amp1(%[[H]], %arg1)
// CHECK-LABEL: func.func private @inner(
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg0
// CHECK:         %[[W16:.*]] = stablehlo.convert %arg1
// CHECK:         stablehlo.dot_general %[[X16]], %[[W16]], {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @inner_amp1(
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @inner_amp0(
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
// Under a policy that decides all three calls alike each scope still has its body.
// F16-LABEL:   func.func @calls_from_two_scopes
// F16:           call @inner(
// F16:           call @inner_amp0(
// F16:           call @inner_amp1(
// F16:           func.func private @inner(
func.func @calls_from_two_scopes(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = func.call @inner(%x, %w) : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/enc/jit(inner)")
  %1 = func.call @inner(%0, %w) : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/head/jit(inner)")
  %2 = func.call @inner(%1, %w) : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dec/jit(inner)")
  return %2 : tensor<2x4xf32>
}
func.func private @inner(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("mm/dot_general")
  return %0 : tensor<2x4xf32>
}

// -----

// Specialisation reaches through nested calls: the clone of @outer calls a clone of @leaf.
// CHECK-LABEL: func.func @nested_calls
// CHECK:         call @outer(
// CHECK:         call @outer_amp0(
// CHECK-LABEL: func.func private @outer(
// CHECK:         call @leaf(
// CHECK-LABEL: func.func private @outer_amp0(
// CHECK:         call @leaf_amp0(
// CHECK-LABEL: func.func private @leaf(
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @leaf_amp0(
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
func.func @nested_calls(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = func.call @outer(%x, %w) : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/enc/jit(outer)")
  %1 = func.call @outer(%0, %w) : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/head/jit(outer)")
  return %1 : tensor<2x4xf32>
}
func.func private @outer(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = func.call @leaf(%x, %w) : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("blk/jit(leaf)")
  %1 = stablehlo.tanh %0 : tensor<2x4xf32>
  return %1 : tensor<2x4xf32>
}
func.func private @leaf(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("dot_general")
  return %0 : tensor<2x4xf32>
}

// -----

// A composite's decomposition is what XLA runs in its place (jax.lax.composite), so its
// matrix ops are decided like a callee's, under the composite's scope: the "head"
// composite's gets a clone kept in f32, the other keeps @decomposed and computes in
// bf16. The composites' own f32 signatures stay.
// CHECK-LABEL: func.func @composites_from_two_scopes
// CHECK:         %[[E:.*]] = stablehlo.composite "my.mm" %arg0, %arg1 {decomposition = @decomposed} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
// CHECK:         stablehlo.composite "my.mm" %[[E]], %arg1 {decomposition = @decomposed_amp0} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @decomposed(
// CHECK-SAME:    -> tensor<2x4xf32>
// CHECK:         %[[X16:.*]] = stablehlo.convert %arg0
// CHECK:         %[[W16:.*]] = stablehlo.convert %arg1
// CHECK:         stablehlo.dot_general %[[X16]], %[[W16]], {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @decomposed_amp0(
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.dot_general %arg0, %arg1, {{.*}} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
func.func @composites_from_two_scopes(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.composite "my.mm" %x, %w {decomposition = @decomposed} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/enc/my.mm")
  %1 = stablehlo.composite "my.mm" %0, %w {decomposition = @decomposed} : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/head/my.mm")
  return %1 : tensor<2x4xf32>
}
func.func private @decomposed(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("mm/dot_general")
  return %0 : tensor<2x4xf32>
}
