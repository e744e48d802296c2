// The accurate mode on XLA:GPU leaves a matrix op f32 when its result has as many
// elements as its operands or more and reaches no other matrix op, only the public
// return (a weight gradient over a small batch that only the optimizer reads), and the
// GPU writes its 16-bit form's result once more (Target.writes_16bit_form_twice): a
// GEMM whose m or n XLA pads to a multiple of 8 for cuBLAS, a convolution (cuDNN returns
// the 16-bit type). The aligned GEMM, the unaligned one whose result feeds another
// matrix op, and one whose operands outweigh its result are converted. Without a
// target, and in the fast mode, everything is converted. A result read by a call, a loop,
// a branch, a custom call or a composite may reach a matrix op there: converted.
//
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy bf16 --target gpu \
// RUN:   | filecheck %s --check-prefix=GPU
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy bf16 \
// RUN:   | filecheck %s --check-prefix=ALL
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy mixed_bfloat16 --target gpu \
// RUN:   | filecheck %s --check-prefix=ALL
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy bf16 --target gpu \
// RUN:   --report - -o /dev/null 2>&1 | filecheck %s --check-prefix=REPORT

// GPU-LABEL: func.func @main
// GPU:         stablehlo.dot_general {{.*}} : (tensor<16x196xf32>, tensor<16x128xf32>) -> tensor<196x128xf32>
// GPU:         stablehlo.dot_general {{.*}} : (tensor<16x192xbf16>, tensor<16x128xbf16>) -> tensor<192x128xf32>
// GPU:         stablehlo.dot_general {{.*}} : (tensor<16x196xbf16>, tensor<16x128xbf16>) -> tensor<196x128xf32>
// GPU:         stablehlo.dot_general {{.*}} : (tensor<196x128xbf16>, tensor<128x4xbf16>) -> tensor<196x4xf32>
// GPU:         stablehlo.dot_general {{.*}} : (tensor<16x128xbf16>, tensor<196x128xbf16>) -> tensor<16x196xf32>
// GPU:         stablehlo.convolution({{.*}}) {{.*}} : (tensor<64x1x1x8xf32>, tensor<1x1x8x32xf32>) -> tensor<64x1x1x32xf32>

// ALL-LABEL:   func.func @main
// ALL-NOT:       (tensor<16x196xf32>, tensor<16x128xf32>)
// ALL-NOT:       (tensor<64x1x1x8xf32>, tensor<1x1x8x32xf32>)

// REPORT: kept f32: its result outweighs its operands and XLA:GPU pads a 16-bit GEMM's 196x128 result
// REPORT: kept f32: its result outweighs its operands and cuDNN returns a 16-bit convolution's result in 16 bit

func.func @main(%x: tensor<16x196xf32>, %g: tensor<16x128xf32>, %w: tensor<196x128xf32>,
                %xa: tensor<16x192xf32>, %wa: tensor<192x128xf32>, %v: tensor<128x4xf32>,
                %act: tensor<64x1x1x8xf32>, %ct: tensor<1x1x8x32xf32>, %f: tensor<64x1x1x32xf32>)
    -> (tensor<196x128xf32>, tensor<192x128xf32>, tensor<196x4xf32>, tensor<16x196xf32>, tensor<64x1x1x32xf32>) {
  %lr = stablehlo.constant dense<1.000000e-01> : tensor<f32>
  %dw = stablehlo.dot_general %x, %g, contracting_dims = [0] x [0] : (tensor<16x196xf32>, tensor<16x128xf32>) -> tensor<196x128xf32> loc("jit(step)/transpose(jvp(fc1))/dot_general")
  %lrb = stablehlo.broadcast_in_dim %lr, dims = [] : (tensor<f32>) -> tensor<196x128xf32>
  %step = stablehlo.multiply %dw, %lrb : tensor<196x128xf32>
  %new = stablehlo.subtract %w, %step : tensor<196x128xf32>
  %dwa = stablehlo.dot_general %xa, %g, contracting_dims = [0] x [0] : (tensor<16x192xf32>, tensor<16x128xf32>) -> tensor<192x128xf32> loc("jit(step)/transpose(jvp(fc2))/dot_general")
  %newa = stablehlo.subtract %wa, %dwa : tensor<192x128xf32>
  %t = stablehlo.dot_general %x, %g, contracting_dims = [0] x [0] : (tensor<16x196xf32>, tensor<16x128xf32>) -> tensor<196x128xf32> loc("jit(step)/jvp(mix)/dot_general")
  %u = stablehlo.dot_general %t, %v, contracting_dims = [1] x [0] : (tensor<196x128xf32>, tensor<128x4xf32>) -> tensor<196x4xf32> loc("jit(step)/jvp(out)/dot_general")
  %dx = stablehlo.dot_general %g, %w, contracting_dims = [1] x [1] : (tensor<16x128xf32>, tensor<196x128xf32>) -> tensor<16x196xf32> loc("jit(step)/transpose(jvp(fc1))/dot_general")
  %df = stablehlo.convolution(%act, %ct) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[0, 0], [0, 0]], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<64x1x1x8xf32>, tensor<1x1x8x32xf32>) -> tensor<64x1x1x32xf32> loc("jit(step)/transpose(jvp(conv))/conv_general_dilated")
  %newf = stablehlo.subtract %f, %df : tensor<64x1x1x32xf32>
  return %new, %newa, %u, %dx, %newf : tensor<196x128xf32>, tensor<192x128xf32>, tensor<196x4xf32>, tensor<16x196xf32>, tensor<64x1x1x32xf32>
}

// Inside a loop the result is a carry that the next trip may read: converted.
// GPU-LABEL: func.func @in_a_loop
// GPU:         stablehlo.dot_general {{.*}} : (tensor<16x196xbf16>, tensor<16x128xbf16>) -> tensor<196x128xf32>
func.func @in_a_loop(%x: tensor<16x196xf32>, %g: tensor<16x128xf32>, %w: tensor<196x128xf32>) -> tensor<196x128xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:2 = stablehlo.while(%i = %c0, %acc = %w) : tensor<i32>, tensor<196x128xf32>
    cond {
      %n = stablehlo.constant dense<2> : tensor<i32>
      %lt = stablehlo.compare LT, %i, %n : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    } do {
      %one = stablehlo.constant dense<1> : tensor<i32>
      %next = stablehlo.add %i, %one : tensor<i32>
      %dw = stablehlo.dot_general %x, %g, contracting_dims = [0] x [0] : (tensor<16x196xf32>, tensor<16x128xf32>) -> tensor<196x128xf32> loc("jit(step)/transpose(jvp(fc1))/dot_general")
      %sum = stablehlo.add %acc, %dw : tensor<196x128xf32>
      stablehlo.return %next, %sum : tensor<i32>, tensor<196x128xf32>
    }
  return %r#1 : tensor<196x128xf32>
}

// Read by a composite whose decomposition holds a matrix op: the result reaches that
// op, not only the return: converted (it was kept f32).
// GPU-LABEL: func.func @into_a_composite
// GPU:         stablehlo.dot_general {{.*}} : (tensor<16x196xbf16>, tensor<16x128xbf16>) -> tensor<196x128xf32>
func.func @into_a_composite(%x: tensor<16x196xf32>, %g: tensor<16x128xf32>, %v: tensor<128x4xf32>) -> tensor<196x4xf32> {
  %dw = stablehlo.dot_general %x, %g, contracting_dims = [0] x [0] : (tensor<16x196xf32>, tensor<16x128xf32>) -> tensor<196x128xf32> loc("jit(step)/transpose(jvp(fc1))/dot_general")
  %c = stablehlo.composite "test.mix" %dw, %v {decomposition = @mix_impl} : (tensor<196x128xf32>, tensor<128x4xf32>) -> tensor<196x4xf32>
  return %c : tensor<196x4xf32>
}

func.func private @mix_impl(%t: tensor<196x128xf32>, %v: tensor<128x4xf32>) -> tensor<196x4xf32> {
  %u = stablehlo.dot_general %t, %v, contracting_dims = [1] x [0] : (tensor<196x128xf32>, tensor<128x4xf32>) -> tensor<196x4xf32> loc("jit(step)/jvp(out)/dot_general")
  return %u : tensor<196x4xf32>
}
