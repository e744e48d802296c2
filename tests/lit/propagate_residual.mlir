// The fast mode's residual rule (hlo-amp-propagate, GPU and TPU): an f32 value computed
// after a deny op in the forward pass that the backward pass reads and that leads,
// through forward ops, to a matrix op (a batch norm's centred output, which the ReLU
// before the next matrix op and the ReLU's backward read) is stored in 16 bit, as a
// Keras or Flax norm layer's output is. A stored value ends the deny region, as the
// layer's 16-bit output does: the ReLU after it runs in 16 bit, and so does the
// activation's backward where it multiplies a matrix op's 16-bit result. On CPU, where
// deny ops pin what they read, nothing changes.
//
// RUN: hlo-amp-opt %s --policy mixed_bfloat16 \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %s --policy mixed_bfloat16 --target tpu \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %s --policy mixed_bfloat16 --debug-info \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | hlo-amp-opt --policy mixed_bfloat16 \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope
// RUN: hlo-amp-opt %s --policy mixed_bfloat16 --target cpu \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=CPU

// CHECK-LABEL: func.func @norm_residual
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<8x4xbf16>
// CHECK:         %[[S:.*]] = stablehlo.reduce({{.*}}) applies stablehlo.add {{.*}} -> tensor<4xf32>
// CHECK:         %[[C:.*]] = stablehlo.subtract %[[D]], %{{.*}} : tensor<8x4xbf16>
// CHECK:         %[[R:.*]] = stablehlo.maximum %[[C]], %{{.*}} : tensor<8x4xbf16>
// CHECK:         stablehlo.dot_general %[[R]], {{.*}} -> tensor<8x4xf32>
// CHECK:         %[[U:.*]] = stablehlo.convert %[[C]] : (tensor<8x4xbf16>) -> tensor<8x4xf32>
// CHECK:         stablehlo.multiply %{{.*}}, %[[U]] : tensor<8x4xf32>
// CPU-LABEL:   func.func @norm_residual
// CPU:           stablehlo.subtract {{.*}} : tensor<8x4xf32>
// CPU:           stablehlo.maximum {{.*}} : tensor<8x4xf32>
func.func @norm_residual(%x: tensor<8x4xf32>, %w1: tensor<4x4xf32>, %w2: tensor<4x4xf32>, %g: tensor<8x4xf32>) -> (tensor<8x4xf32>, tensor<8x4xf32>) {
  %0 = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(step)/jvp(conv)/dot_general")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(step)/jvp(bn)/reduce_sum")
  %1 = stablehlo.reduce(%0 init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32> loc("jit(step)/jvp(bn)/reduce_sum")
  %2 = stablehlo.broadcast_in_dim %1, dims = [1] : (tensor<4xf32>) -> tensor<8x4xf32> loc("jit(step)/jvp(bn)/broadcast_in_dim")
  %3 = stablehlo.subtract %0, %2 : tensor<8x4xf32> loc("jit(step)/jvp(bn)/sub")
  %z = stablehlo.constant dense<0.000000e+00> : tensor<8x4xf32> loc("jit(step)/jvp(act)/max")
  %4 = stablehlo.maximum %3, %z : tensor<8x4xf32> loc("jit(step)/jvp(act)/max")
  %5 = stablehlo.dot_general %4, %w2, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(step)/jvp(dense)/dot_general")
  %6 = stablehlo.multiply %g, %3 : tensor<8x4xf32> loc("jit(step)/transpose(jvp(act))/mul")
  return %5, %6 : tensor<8x4xf32>, tensor<8x4xf32>
}

// A statistic is no residual: the softmax's sum, broadcast, which the backward reads
// too, stays f32 there (the backward divides by the exact sum; the forward's divide
// reads a 16-bit copy, which XLA:GPU folds into an f32 divide rounded once); the
// probabilities, full-shape, which the next matrix op and the backward read, are
// stored in 16 bit.
// CHECK-LABEL: func.func @softmax_sum_stays_f32
// CHECK:         %[[SUM:.*]] = stablehlo.reduce({{.*}}) applies stablehlo.add {{.*}} -> tensor<8xf32>
// CHECK:         %[[B:.*]] = stablehlo.broadcast_in_dim %[[SUM]], dims = [0] : (tensor<8xf32>) -> tensor<8x4xf32>
// CHECK:         %[[P:.*]] = stablehlo.divide {{.*}} : tensor<8x4xbf16>
// CHECK:         stablehlo.dot_general %[[P]], {{.*}} -> tensor<8x4xf32>
// CHECK:         %[[PU:.*]] = stablehlo.convert %[[P]] : (tensor<8x4xbf16>) -> tensor<8x4xf32>
// CHECK:         %[[GP:.*]] = stablehlo.multiply %{{.*}}, %[[PU]] : tensor<8x4xf32>
// CHECK:         stablehlo.divide %[[GP]], %[[B]] : tensor<8x4xf32>
// CPU-LABEL:   func.func @softmax_sum_stays_f32
// CPU:           stablehlo.divide {{.*}} : tensor<8x4xf32>
func.func @softmax_sum_stays_f32(%x: tensor<8x4xf32>, %w1: tensor<4x4xf32>, %w2: tensor<4x4xf32>, %g: tensor<8x4xf32>) -> (tensor<8x4xf32>, tensor<8x4xf32>) {
  %0 = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(step)/jvp(q)/dot_general")
  %1 = stablehlo.exponential %0 : tensor<8x4xf32> loc("jit(step)/jvp(softmax)/exp")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(step)/jvp(softmax)/reduce_sum")
  %2 = stablehlo.reduce(%1 init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<8x4xf32>, tensor<f32>) -> tensor<8xf32> loc("jit(step)/jvp(softmax)/reduce_sum")
  %3 = stablehlo.broadcast_in_dim %2, dims = [0] : (tensor<8xf32>) -> tensor<8x4xf32> loc("jit(step)/jvp(softmax)/broadcast_in_dim")
  %4 = stablehlo.divide %1, %3 : tensor<8x4xf32> loc("jit(step)/jvp(softmax)/div")
  %5 = stablehlo.dot_general %4, %w2, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(step)/jvp(v)/dot_general")
  %6 = stablehlo.multiply %g, %4 : tensor<8x4xf32> loc("jit(step)/transpose(jvp(softmax))/mul")
  %7 = stablehlo.divide %6, %3 : tensor<8x4xf32> loc("jit(step)/transpose(jvp(softmax))/div")
  return %5, %7 : tensor<8x4xf32>, tensor<8x4xf32>
}

// The backward of an activation after a stored value: the activation gradient (a
// matrix op's 16-bit result) times the stored norm output, on its way to the next
// matrix op, is 16-bit, as in Keras's and Flax's bf16 layers; before the stored value
// ended the deny region it was computed and held in f32.
// CHECK-LABEL: func.func @stored_value_ends_deny
// CHECK:         %[[C:.*]] = stablehlo.subtract {{.*}} : tensor<8x4xbf16>
// CHECK:         %[[A:.*]] = stablehlo.multiply %[[C]], %[[C]] : tensor<8x4xbf16>
// CHECK:         stablehlo.dot_general %[[A]], {{.*}} -> tensor<8x4xf32>
// CHECK:         %[[G:.*]] = stablehlo.dot_general {{.*}} -> tensor<8x4xbf16>
// CHECK:         %[[GA:.*]] = stablehlo.multiply %[[G]], %[[C]] : tensor<8x4xbf16>
// CHECK:         stablehlo.dot_general %[[GA]], {{.*}} -> tensor<8x4xf32>
// CPU-LABEL:   func.func @stored_value_ends_deny
// CPU:           stablehlo.multiply {{.*}} : tensor<8x4xf32>
func.func @stored_value_ends_deny(%x: tensor<8x4xf32>, %w1: tensor<4x4xf32>, %w2: tensor<4x4xf32>, %gy: tensor<8x4xf32>) -> (tensor<8x4xf32>, tensor<8x4xf32>) {
  %0 = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(step)/jvp(conv)/dot_general")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(step)/jvp(bn)/reduce_sum")
  %1 = stablehlo.reduce(%0 init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x4xf32>, tensor<f32>) -> tensor<4xf32> loc("jit(step)/jvp(bn)/reduce_sum")
  %2 = stablehlo.broadcast_in_dim %1, dims = [1] : (tensor<4xf32>) -> tensor<8x4xf32> loc("jit(step)/jvp(bn)/broadcast_in_dim")
  %3 = stablehlo.subtract %0, %2 : tensor<8x4xf32> loc("jit(step)/jvp(bn)/sub")
  %4 = stablehlo.multiply %3, %3 : tensor<8x4xf32> loc("jit(step)/jvp(act)/mul")
  %5 = stablehlo.dot_general %4, %w2, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(step)/jvp(dense)/dot_general")
  %6 = stablehlo.dot_general %gy, %w2, contracting_dims = [1] x [1] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(step)/transpose(jvp(dense))/dot_general")
  %7 = stablehlo.multiply %6, %3 : tensor<8x4xf32> loc("jit(step)/transpose(jvp(act))/mul")
  %8 = stablehlo.dot_general %7, %w1, contracting_dims = [1] x [1] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(step)/transpose(jvp(conv))/dot_general")
  return %5, %8 : tensor<8x4xf32>, tensor<8x4xf32>
}
