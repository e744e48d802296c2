// The propagation pass (mixed_* modes): 16-bit regions from the converted matrix ops
// through infer/clear ops, never through deny ops. Default target (GPU): matrix ops in a
// region return the 16-bit type; --target cpu keeps their f32 result and a convert, and
// there a deny op pins the value it reads (CpuTarget.deny_pins_its_inputs).
//
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope
//
// Idempotence: the pipeline run on its own (located) output changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --debug-info \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | hlo-amp-opt --split-input-file --policy mixed_bfloat16 \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope
//
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target cpu \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=CPU
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_float16 \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=F16
// RUN: hlo-amp-opt %s --split-input-file --policy 'mixed_bfloat16,scope:head=float32' \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=SCOPE
// RUN: hlo-amp-opt %s --split-input-file \
// RUN:   --policy 'mixed_bfloat16,op:tanh=float32,op:exponential=compute' \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=OPRULE
// RUN: hlo-amp-opt %s --split-input-file --policy 'mixed_bfloat16,keep_f32_results=true' \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=KEEP
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target gpu \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=GPU
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target tpu \
// RUN:   --pass hlo-amp-insert-converts --pass hlo-amp-propagate --pass hlo-amp-cleanup \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=TPU
// The accurate mode never runs the pass: activations stay f32.
// RUN: hlo-amp-opt %s --split-input-file --policy bf16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=ACCURATE

// Infer ops between two matrix ops are painted; the bias is converted before its
// broadcast; the first dot returns bf16; the last dot feeds the f32 return and keeps f32.
// CHECK-LABEL: func.func @infer_between_dots
// CHECK-SAME:    (%[[X:.*]]: tensor<2x4xf32>, %[[W1:.*]]: tensor<4x4xf32>, %[[B:.*]]: tensor<4xf32>, %[[W2:.*]]: tensor<4x3xf32>) -> tensor<2x3xf32>
// CHECK:         %[[X16:.*]] = stablehlo.convert %[[X]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[W116:.*]] = stablehlo.convert %[[W1]] : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// CHECK:         %[[D1:.*]] = stablehlo.dot_general %[[X16]], %[[W116]], {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[B16:.*]] = stablehlo.convert %[[B]] : (tensor<4xf32>) -> tensor<4xbf16>
// CHECK:         %[[BB:.*]] = stablehlo.broadcast_in_dim %[[B16]], dims = [1] : (tensor<4xbf16>) -> tensor<2x4xbf16>
// CHECK:         %[[S:.*]] = stablehlo.add %[[D1]], %[[BB]] : tensor<2x4xbf16>
// CHECK:         %[[T:.*]] = stablehlo.tanh %[[S]] : tensor<2x4xbf16>
// CHECK:         %[[W216:.*]] = stablehlo.convert %[[W2]] : (tensor<4x3xf32>) -> tensor<4x3xbf16>
// CHECK:         %[[D2:.*]] = stablehlo.dot_general %[[T]], %[[W216]], {{.*}} -> tensor<2x3xf32>
// CHECK-NOT:     stablehlo.convert
// CHECK:         return %[[D2]] : tensor<2x3xf32>
// CPU-LABEL:   func.func @infer_between_dots
// CPU:           %[[D1:.*]] = stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
// CPU:           %[[D116:.*]] = stablehlo.convert %[[D1]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CPU:           %[[S:.*]] = stablehlo.add %[[D116]], %{{.*}} : tensor<2x4xbf16>
// CPU:           %[[T:.*]] = stablehlo.tanh %[[S]] : tensor<2x4xbf16>
// CPU:           stablehlo.dot_general %[[T]], {{.*}} -> tensor<2x3xf32>
// F16-LABEL:   func.func @infer_between_dots
// F16:           %[[D1:.*]] = stablehlo.dot_general {{.*}} : (tensor<2x4xf16>, tensor<4x4xf16>) -> tensor<2x4xf16>
// F16:           %[[S:.*]] = stablehlo.add %[[D1]], %{{.*}} : tensor<2x4xf16>
// F16:           %[[T:.*]] = stablehlo.tanh %[[S]] : tensor<2x4xf16>
// F16:           stablehlo.dot_general %[[T]], {{.*}} -> tensor<2x3xf32>
// A scope rule bounds the region: tanh and the second dot sit in "head" and stay f32,
// and the add that feeds them stays f32 with them (deny wins); the first dot returns
// bf16 and the f32 add converts it up, as an f32 region reads a 16-bit producer.
// SCOPE-LABEL: func.func @infer_between_dots
// SCOPE:         %[[D1:.*]] = stablehlo.dot_general {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xbf16>
// SCOPE:         %[[D132:.*]] = stablehlo.convert %[[D1]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// SCOPE:         stablehlo.add %[[D132]], %{{.*}} : tensor<2x4xf32>
// SCOPE:         %[[T:.*]] = stablehlo.tanh %{{.*}} : tensor<2x4xf32>
// SCOPE:         stablehlo.dot_general %[[T]], {{.*}} : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>
// OPRULE-LABEL: func.func @infer_between_dots
// OPRULE:         stablehlo.tanh %{{.*}} : tensor<2x4xf32>
// ACCURATE-LABEL: func.func @infer_between_dots
// ACCURATE:         stablehlo.dot_general {{.*}} -> tensor<2x4xf32>
// ACCURATE:         stablehlo.add %{{.*}}, %{{.*}} : tensor<2x4xf32>
// ACCURATE:         stablehlo.tanh %{{.*}} : tensor<2x4xf32>
func.func @infer_between_dots(%x: tensor<2x4xf32>, %w1: tensor<4x4xf32>, %b: tensor<4xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dense1/dot_general")
  %1 = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<4xf32>) -> tensor<2x4xf32> loc("jit(f)/dense1/broadcast_in_dim")
  %2 = stablehlo.add %0, %1 : tensor<2x4xf32> loc("jit(f)/dense1/add")
  %3 = stablehlo.tanh %2 : tensor<2x4xf32> loc("jit(f)/head/tanh")
  %4 = stablehlo.dot_general %3, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/head/dense2/dot_general")
  return %4 : tensor<2x3xf32>
}

// -----

// An infer op next to a 16-bit op on one side only is left alone: after the last dot
// (nothing 16-bit reads it) and before the first (nothing 16-bit feeds it). The last
// dot still returns bf16, as TensorFlow's and PyTorch's AMP write every matmul result:
// the f32 tanh converts it up itself. keep_f32_results keeps its f32 result, and so
// does the CPU target (no bytes to gain there, only rounding).
// CHECK-LABEL: func.func @infer_one_side
// CHECK:         %[[T0:.*]] = stablehlo.tanh %{{.*}} : tensor<2x4xf32>
// CHECK:         %[[T016:.*]] = stablehlo.convert %[[T0]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[D:.*]] = stablehlo.dot_general %[[T016]], {{.*}} -> tensor<2x3xbf16>
// CHECK:         %[[D32:.*]] = stablehlo.convert %[[D]] : (tensor<2x3xbf16>) -> tensor<2x3xf32>
// CHECK:         %[[T:.*]] = stablehlo.tanh %[[D32]] : tensor<2x3xf32>
// CHECK:         return %[[T]] : tensor<2x3xf32>
// KEEP-LABEL: func.func @infer_one_side
// KEEP:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x3xf32>
// KEEP:         %[[T:.*]] = stablehlo.tanh %[[D]] : tensor<2x3xf32>
// KEEP:         return %[[T]] : tensor<2x3xf32>
// CPU-LABEL: func.func @infer_one_side
// CPU:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x3xf32>
// CPU:         %[[T:.*]] = stablehlo.tanh %[[D]] : tensor<2x3xf32>
// CPU:         return %[[T]] : tensor<2x3xf32>
func.func @infer_one_side(%x: tensor<2x4xf32>, %w: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.tanh %x : tensor<2x4xf32> loc("jit(f)/tanh")
  %1 = stablehlo.dot_general %0, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  %2 = stablehlo.tanh %1 : tensor<2x3xf32> loc("jit(f)/tanh")
  return %2 : tensor<2x3xf32>
}

// -----

// Clear ops (data movement) between two dots are carried in bf16.
// CHECK-LABEL: func.func @clear_ops
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[R:.*]] = stablehlo.reshape %[[D]] : (tensor<2x4xbf16>) -> tensor<4x2xbf16>
// CHECK:         %[[T:.*]] = stablehlo.transpose %[[R]], dims = [1, 0] : (tensor<4x2xbf16>) -> tensor<2x4xbf16>
// CHECK:         %[[S:.*]] = stablehlo.slice %[[T]] [0:2, 0:3] : (tensor<2x4xbf16>) -> tensor<2x3xbf16>
// CHECK:         %[[P:.*]] = stablehlo.pad %[[S]], %{{.*}}, low = [0, 0], high = [0, 1], interior = [0, 0] : (tensor<2x3xbf16>, tensor<bf16>) -> tensor<2x4xbf16>
// CHECK:         %[[M:.*]] = stablehlo.reduce(%[[P]] init: %{{.*}}) applies stablehlo.maximum across dimensions = [1] : (tensor<2x4xbf16>, tensor<bf16>) -> tensor<2xbf16>
// CHECK:         %[[B:.*]] = stablehlo.broadcast_in_dim %[[M]], dims = [0] : (tensor<2xbf16>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[B]], {{.*}} : (tensor<2x4xbf16>, tensor<4x3xbf16>) -> tensor<2x3xf32>
func.func @clear_ops(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = stablehlo.reshape %0 : (tensor<2x4xf32>) -> tensor<4x2xf32> loc("jit(f)/reshape")
  %2 = stablehlo.transpose %1, dims = [1, 0] : (tensor<4x2xf32>) -> tensor<2x4xf32> loc("jit(f)/transpose")
  %3 = stablehlo.slice %2 [0:2, 0:3] : (tensor<2x4xf32>) -> tensor<2x3xf32> loc("jit(f)/slice")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(f)/pad")
  %4 = stablehlo.pad %3, %zero, low = [0, 0], high = [0, 1], interior = [0, 0] : (tensor<2x3xf32>, tensor<f32>) -> tensor<2x4xf32> loc("jit(f)/pad")
  %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32> loc("jit(f)/reduce_max")
  %5 = stablehlo.reduce(%4 init: %ninf) applies stablehlo.maximum across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32> loc("jit(f)/reduce_max")
  %6 = stablehlo.broadcast_in_dim %5, dims = [0] : (tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/broadcast_in_dim")
  %7 = stablehlo.dot_general %6, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %7 : tensor<2x3xf32>
}

// -----

// Every deny op stays f32 and computes from f32 inputs. The dot before them reaches the
// last dot through them (they convert their own input), so its result sits between
// matrix ops: 16-bit, converted up in front of the exponential (as PyTorch autocast's
// matmul result before its f32 exp). With op:exponential=compute the exponential may be
// painted too; log is still deny.
// CHECK-LABEL: func.func @deny_ops
// CHECK:         %[[D16:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[D:.*]] = stablehlo.convert %[[D16]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         %[[E:.*]] = stablehlo.exponential %[[D]] : tensor<2x4xf32>
// CHECK:         %[[L:.*]] = stablehlo.log %[[E]] : tensor<2x4xf32>
// CHECK:         %[[R:.*]] = stablehlo.rsqrt %[[L]] : tensor<2x4xf32>
// CHECK:         %[[M:.*]] = stablehlo.exponential_minus_one %[[R]] : tensor<2x4xf32>
// CHECK:         %[[P:.*]] = stablehlo.log_plus_one %[[M]] : tensor<2x4xf32>
// CHECK:         %[[W:.*]] = stablehlo.power %[[P]], %[[P]] : tensor<2x4xf32>
// CHECK:         %[[RP:.*]] = stablehlo.reduce_precision %[[W]], format = e8m7 : tensor<2x4xf32>
// CHECK:         %[[OB:.*]] = stablehlo.optimization_barrier %[[RP]] : tensor<2x4xf32>
// CHECK:         %[[OB16:.*]] = stablehlo.convert %[[OB]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[OB16]], {{.*}} -> tensor<2x3xf32>
// OPRULE-LABEL: func.func @deny_ops
// OPRULE:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// OPRULE:         %[[E:.*]] = stablehlo.exponential %[[D]] : tensor<2x4xbf16>
// OPRULE:         %[[E32:.*]] = stablehlo.convert %[[E]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// OPRULE:         stablehlo.log %[[E32]] : tensor<2x4xf32>
func.func @deny_ops(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = stablehlo.exponential %0 : tensor<2x4xf32> loc("jit(f)/exp")
  %2 = stablehlo.log %1 : tensor<2x4xf32> loc("jit(f)/log")
  %3 = stablehlo.rsqrt %2 : tensor<2x4xf32> loc("jit(f)/rsqrt")
  %4 = stablehlo.exponential_minus_one %3 : tensor<2x4xf32> loc("jit(f)/expm1")
  %5 = stablehlo.log_plus_one %4 : tensor<2x4xf32> loc("jit(f)/log1p")
  %6 = stablehlo.power %5, %5 : tensor<2x4xf32> loc("jit(f)/pow")
  %7 = stablehlo.reduce_precision %6, format = e8m7 : tensor<2x4xf32> loc("jit(f)/reduce_precision")
  %8 = stablehlo.optimization_barrier %7 : tensor<2x4xf32> loc("jit(f)/optimization_barrier")
  %9 = stablehlo.dot_general %8, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %9 : tensor<2x3xf32>
}

// -----

// op:exponential=compute moves exp into the paintable classes: painted between dots.
// Without it exp is deny: f32 from the 16-bit dot result it converts up.
// CHECK-LABEL: func.func @exp_between_dots
// CHECK:         %[[D16:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[D:.*]] = stablehlo.convert %[[D16]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         %[[E:.*]] = stablehlo.exponential %[[D]] : tensor<2x4xf32>
// CHECK:         %[[E16:.*]] = stablehlo.convert %[[E]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[E16]], {{.*}} -> tensor<2x3xf32>
// OPRULE-LABEL: func.func @exp_between_dots
// OPRULE:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// OPRULE:         %[[E:.*]] = stablehlo.exponential %[[D]] : tensor<2x4xbf16>
// OPRULE:         stablehlo.dot_general %[[E]], {{.*}} -> tensor<2x3xf32>
func.func @exp_between_dots(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = stablehlo.exponential %0 : tensor<2x4xf32> loc("jit(f)/exp")
  %2 = stablehlo.dot_general %1, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %2 : tensor<2x3xf32>
}

// -----

// A deny op converts its own input and pins nothing (TensorFlow's and PyTorch autocast's
// way): the dot result feeds a sum and a tanh that leads to a dot; it is 16-bit, the
// tanh is painted, and the sum reads an f32 convert of it.
// CHECK-LABEL: func.func @deny_converts_its_input
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         stablehlo.tanh %[[D]] : tensor<2x4xbf16>
// CHECK:         %[[U:.*]] = stablehlo.convert %[[D]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         stablehlo.reduce(%[[U]] init: %{{.*}}) applies stablehlo.add across dimensions = [0, 1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<f32>
// On CPU the sum pins the dot's f32 result, and the tanh after it stays f32 (converted
// for the next dot).
// CPU-LABEL:   func.func @deny_converts_its_input
// CPU:           %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xf32>
// CPU:           %[[T:.*]] = stablehlo.tanh %[[D]] : tensor<2x4xf32>
// CPU:           %[[T16:.*]] = stablehlo.convert %[[T]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CPU:           stablehlo.dot_general %[[T16]], {{.*}} -> tensor<2x3xf32>
// CPU:           stablehlo.reduce(%[[D]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<f32>
func.func @deny_converts_its_input(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %w2: tensor<4x3xf32>) -> (tensor<2x3xf32>, tensor<f32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = stablehlo.tanh %0 : tensor<2x4xf32> loc("jit(f)/tanh")
  %2 = stablehlo.dot_general %1, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(f)/reduce_sum")
  %3 = stablehlo.reduce(%0 init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<f32> loc("jit(f)/reduce_sum")
  return %2, %3 : tensor<2x3xf32>, tensor<f32>
}

// -----

// Where deny's forward spread ends: an f32 value downstream of a deny op that a matrix op
// reads and f32 ops read as well (the residual gradient a layer norm's backward adds to)
// is stored once in 16 bit: the multiply is painted (the sum converted before its
// broadcast), the dot reads it as it is, and the tanh converts it up. (Read only by matrix ops and deny ops, as in @deny_spreads_forward
// below, it stays f32.)
// CHECK-LABEL: func.func @after_deny_read_by_dot_and_f32
// CHECK:         %[[D16:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[D:.*]] = stablehlo.convert %[[D16]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         %[[S:.*]] = stablehlo.reduce(%[[D]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// CHECK:         %[[S16:.*]] = stablehlo.convert %[[S]] : (tensor<2xf32>) -> tensor<2xbf16>
// CHECK:         %[[B16:.*]] = stablehlo.broadcast_in_dim %[[S16]], {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[M:.*]] = stablehlo.multiply %[[D16]], %[[B16]] : tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[M]], {{.*}} -> tensor<2x3xf32>
// CHECK:         %[[M32:.*]] = stablehlo.convert %[[M]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         stablehlo.tanh %[[M32]] : tensor<2x4xf32>
func.func @after_deny_read_by_dot_and_f32(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %w2: tensor<4x3xf32>) -> (tensor<2x3xf32>, tensor<2x4xf32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(f)/reduce_sum")
  %1 = stablehlo.reduce(%0 init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32> loc("jit(f)/reduce_sum")
  %2 = stablehlo.broadcast_in_dim %1, dims = [0] : (tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/broadcast_in_dim")
  %3 = stablehlo.multiply %0, %2 : tensor<2x4xf32> loc("jit(f)/mul")
  %4 = stablehlo.dot_general %3, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  %5 = stablehlo.tanh %3 : tensor<2x4xf32> loc("jit(f)/tanh")
  return %4, %5 : tensor<2x3xf32>, tensor<2x4xf32>
}

// -----

// A value with nothing 16-bit upstream that a painted op reads is stored once in 16 bit:
// the embedding plus positions (%0) that the residual add after the first dot reads and
// a layer norm's sum and centring read in f32. The add is painted (its inputs converted
// before it: the lookup reads a 16-bit table), the sum and the multiply convert it up.
// (Without the residual add, as in @deny_spreads_forward's sum, nothing paints it; two
// f32 arguments added are data, not a lookup's rows: kept f32 as JAX's promotion keeps
// them, @data_beside_the_model below.)
// CHECK-LABEL: func.func @before_region_read_by_painted_and_f32
// CHECK:         %[[T16:.*]] = stablehlo.convert %arg0 : (tensor<8x4xf32>) -> tensor<8x4xbf16>
// CHECK:         %[[E16:.*]] = "stablehlo.gather"(%[[T16]], %arg1) {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[P16:.*]] = stablehlo.convert %arg2 : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[X16:.*]] = stablehlo.add %[[E16]], %[[P16]] : tensor<2x4xbf16>
// CHECK:         %[[X:.*]] = stablehlo.convert %[[X16]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         stablehlo.reduce(%[[X]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// CHECK:         %[[N:.*]] = stablehlo.multiply %[[X]], %{{.*}} : tensor<2x4xf32>
// CHECK:         %[[N16:.*]] = stablehlo.convert %[[N]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[D:.*]] = stablehlo.dot_general %[[N16]], {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[R:.*]] = stablehlo.add %[[X16]], %[[D]] : tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[R]], {{.*}} -> tensor<2x3xf32>
func.func @before_region_read_by_painted_and_f32(%table: tensor<8x4xf32>, %ids: tensor<2x1xi32>, %p: tensor<2x4xf32>, %w: tensor<4x4xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %e = "stablehlo.gather"(%table, %ids) <{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, 4>}> : (tensor<8x4xf32>, tensor<2x1xi32>) -> tensor<2x4xf32> loc("jit(f)/gather")
  %0 = stablehlo.add %e, %p : tensor<2x4xf32> loc("jit(f)/add")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(f)/reduce_sum")
  %1 = stablehlo.reduce(%0 init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32> loc("jit(f)/reduce_sum")
  %2 = stablehlo.broadcast_in_dim %1, dims = [0] : (tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/broadcast_in_dim")
  %3 = stablehlo.multiply %0, %2 : tensor<2x4xf32> loc("jit(f)/mul")
  %4 = stablehlo.dot_general %3, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %5 = stablehlo.add %0, %4 : tensor<2x4xf32> loc("jit(f)/add")
  %6 = stablehlo.dot_general %5, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %6 : tensor<2x3xf32>
}

// -----

// Data is no activation: a residual stream that starts at an f32 argument (states near
// 100: bf16 steps by 0.5 there) stays f32 where it meets the model's values, as JAX's
// promotion keeps a hand cast's; the dots read 16-bit copies. A bias broadcast is no
// data: the tanh's add stays 16-bit.
// CHECK-LABEL: func.func @data_beside_the_model
// CHECK:         %[[H:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[HB:.*]] = stablehlo.add %[[H]], {{.*}} : tensor<2x4xbf16>
// CHECK:         %[[T:.*]] = stablehlo.tanh %[[HB]] : tensor<2x4xbf16>
// CHECK:         %[[T32:.*]] = stablehlo.convert %[[T]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         %[[S:.*]] = stablehlo.add %arg0, %[[T32]] : tensor<2x4xf32>
// CHECK:         %[[S16:.*]] = stablehlo.convert %[[S]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[S16]], {{.*}} -> tensor<2x3xf32>
func.func @data_beside_the_model(%s: tensor<2x4xf32>, %w: tensor<4x4xf32>, %b: tensor<4xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %s, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<4xf32>) -> tensor<2x4xf32> loc("jit(f)/broadcast_in_dim")
  %2 = stablehlo.add %0, %1 : tensor<2x4xf32> loc("jit(f)/add")
  %3 = stablehlo.tanh %2 : tensor<2x4xf32> loc("jit(f)/tanh")
  %4 = stablehlo.add %s, %3 : tensor<2x4xf32> loc("jit(f)/add")
  %5 = stablehlo.dot_general %4, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %5 : tensor<2x3xf32>
}

// -----

// Deny spreads forward, through infer ops only (TensorFlow's rule): the multiply by the
// broadcast sum and the tanh after it stay f32 and convert for the dot; a reshape of the
// sum that leads only to a dot is data movement, not arithmetic: it moves 16-bit values.
// The first dot's result reaches both dots through those f32 ops: 16-bit, converted up
// once for them.
// CHECK-LABEL: func.func @deny_spreads_forward
// CHECK:         %[[D16:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[D:.*]] = stablehlo.convert %[[D16]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         %[[S:.*]] = stablehlo.reduce(%[[D]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// CHECK:         %[[M:.*]] = stablehlo.multiply %[[D]], %{{.*}} : tensor<2x4xf32>
// CHECK:         %[[T:.*]] = stablehlo.tanh %[[M]] : tensor<2x4xf32>
// CHECK:         %[[T16:.*]] = stablehlo.convert %[[T]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[T16]], {{.*}} -> tensor<2x3xf32>
// CHECK:         %[[S16:.*]] = stablehlo.convert %[[S]] : (tensor<2xf32>) -> tensor<2xbf16>
// CHECK:         %[[R:.*]] = stablehlo.reshape %[[S16]] : (tensor<2xbf16>) -> tensor<2x1xbf16>
// CHECK:         stablehlo.dot_general %[[R]], {{.*}} -> tensor<2x3xf32>
func.func @deny_spreads_forward(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %w2: tensor<4x3xf32>, %w3: tensor<1x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(f)/reduce_sum")
  %1 = stablehlo.reduce(%0 init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32> loc("jit(f)/reduce_sum")
  %2 = stablehlo.broadcast_in_dim %1, dims = [0] : (tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/broadcast_in_dim")
  %3 = stablehlo.multiply %0, %2 : tensor<2x4xf32> loc("jit(f)/mul")
  %4 = stablehlo.tanh %3 : tensor<2x4xf32> loc("jit(f)/tanh")
  %5 = stablehlo.dot_general %4, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  %6 = stablehlo.reshape %1 : (tensor<2xf32>) -> tensor<2x1xf32> loc("jit(f)/reshape")
  %7 = stablehlo.dot_general %6, %w3, contracting_dims = [1] x [0] : (tensor<2x1xf32>, tensor<1x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %5, %7 : tensor<2x3xf32>, tensor<2x3xf32>
}

// -----

// Softmax as jax.nn.softmax lowers it (max, subtract, exp, sum, divide): the exp and
// the sum stay f32 and convert their own input; the scores, their max and the subtract
// feed the next dot through the exp, so they are bf16 (as in Flax); the divide is
// downstream of the exp and the sum (deny spreads forward); its result is converted for
// the next dot.
// CHECK-LABEL: func.func @softmax
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         stablehlo.reduce(%[[D]] init: %{{.*}}) applies stablehlo.maximum {{.*}} -> tensor<2xbf16>
// CHECK:         %[[S:.*]] = stablehlo.subtract %[[D]], %{{.*}} : tensor<2x4xbf16>
// CHECK:         %[[S32:.*]] = stablehlo.convert %[[S]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         %[[E:.*]] = stablehlo.exponential %[[S32]] : tensor<2x4xf32>
// CHECK:         stablehlo.reduce(%[[E]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// CHECK:         %[[Q:.*]] = stablehlo.divide %[[E]], %{{.*}} : tensor<2x4xf32>
// CHECK:         %[[Q16:.*]] = stablehlo.convert %[[Q]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[Q16]], {{.*}} -> tensor<2x3xf32>
func.func @softmax(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %v: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32> loc("jit(f)/softmax/reduce_max")
  %1 = stablehlo.reduce(%0 init: %ninf) applies stablehlo.maximum across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32> loc("jit(f)/softmax/reduce_max")
  %2 = stablehlo.broadcast_in_dim %1, dims = [0] : (tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/softmax/broadcast_in_dim")
  %3 = stablehlo.subtract %0, %2 : tensor<2x4xf32> loc("jit(f)/softmax/sub")
  %4 = stablehlo.exponential %3 : tensor<2x4xf32> loc("jit(f)/softmax/exp")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(f)/softmax/reduce_sum")
  %5 = stablehlo.reduce(%4 init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32> loc("jit(f)/softmax/reduce_sum")
  %6 = stablehlo.broadcast_in_dim %5, dims = [0] : (tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/softmax/broadcast_in_dim")
  %7 = stablehlo.divide %4, %6 : tensor<2x4xf32> loc("jit(f)/softmax/div")
  %8 = stablehlo.dot_general %7, %v, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %8 : tensor<2x3xf32>
}

// -----

// Layer norm as JAX lowers it (mean, centre, variance, rsqrt, scale): the sums and the
// rsqrt stay f32, and so does the rest: it is downstream of the mean (deny spreads
// forward through infer ops). The dot before it is 16-bit: its result reaches the next
// dot through the layer norm, which converts it up.
// CHECK-LABEL: func.func @layer_norm
// CHECK:         %[[D16:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[D:.*]] = stablehlo.convert %[[D16]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         stablehlo.reduce(%[[D]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// CHECK:         %[[C:.*]] = stablehlo.subtract %[[D]], %{{.*}} : tensor<2x4xf32>
// CHECK:         stablehlo.multiply %[[C]], %[[C]] : tensor<2x4xf32>
// CHECK:         stablehlo.reduce({{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// CHECK:         stablehlo.rsqrt %{{.*}} : tensor<2xf32>
// CHECK:         %[[N:.*]] = stablehlo.multiply %[[C]], %{{.*}} : tensor<2x4xf32>
// CHECK:         %[[N16:.*]] = stablehlo.convert %[[N]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[N16]], {{.*}} -> tensor<2x3xf32>
func.func @layer_norm(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(f)/ln/reduce_sum")
  %four = stablehlo.constant dense<4.000000e+00> : tensor<2xf32> loc("jit(f)/ln/div")
  %1 = stablehlo.reduce(%0 init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32> loc("jit(f)/ln/reduce_sum")
  %2 = stablehlo.divide %1, %four : tensor<2xf32> loc("jit(f)/ln/div")
  %3 = stablehlo.broadcast_in_dim %2, dims = [0] : (tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/ln/broadcast_in_dim")
  %4 = stablehlo.subtract %0, %3 : tensor<2x4xf32> loc("jit(f)/ln/sub")
  %5 = stablehlo.multiply %4, %4 : tensor<2x4xf32> loc("jit(f)/ln/square")
  %6 = stablehlo.reduce(%5 init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32> loc("jit(f)/ln/reduce_sum")
  %7 = stablehlo.divide %6, %four : tensor<2xf32> loc("jit(f)/ln/div")
  %8 = stablehlo.rsqrt %7 : tensor<2xf32> loc("jit(f)/ln/rsqrt")
  %9 = stablehlo.broadcast_in_dim %8, dims = [0] : (tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/ln/broadcast_in_dim")
  %10 = stablehlo.multiply %4, %9 : tensor<2x4xf32> loc("jit(f)/ln/mul")
  %11 = stablehlo.dot_general %10, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %11 : tensor<2x3xf32>
}

// -----

// A pre-LN residual block: the residual add sits between two dots (the one feeding it
// and the one after the layer norm), so it is bf16 although the layer norm's mean and
// centring, which read it, are f32 and convert it themselves. (The stream an earlier
// matrix op made: an f32 argument there is data, kept f32 as @data_beside_the_model.)
// CHECK-LABEL: func.func @residual_before_layer_norm
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[R:.*]] = stablehlo.add %[[D]], %{{.*}} : tensor<2x4xbf16>
// CHECK:         %[[R32:.*]] = stablehlo.convert %[[R]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         stablehlo.reduce(%[[R32]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// CHECK:         %[[C:.*]] = stablehlo.subtract %[[R32]], %{{.*}} : tensor<2x4xf32>
// CHECK:         %[[N16:.*]] = stablehlo.convert %[[C]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[N16]], {{.*}} -> tensor<2x3xf32>
// On CPU the layer norm's mean pins the residual add: f32, converted once for the dot.
// CPU-LABEL:   func.func @residual_before_layer_norm
// CPU:           %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xf32>
// CPU:           %[[R:.*]] = stablehlo.add %[[D]], %{{.*}} : tensor<2x4xf32>
// CPU:           stablehlo.reduce(%[[R]] init: %{{.*}}) applies stablehlo.add {{.*}} -> tensor<2xf32>
// CPU:           %[[C:.*]] = stablehlo.subtract %[[R]], %{{.*}} : tensor<2x4xf32>
// CPU:           %[[C16:.*]] = stablehlo.convert %[[C]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CPU:           stablehlo.dot_general %[[C16]], {{.*}} -> tensor<2x3xf32>
func.func @residual_before_layer_norm(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %w0: tensor<4x4xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %res = stablehlo.dot_general %x, %w0, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = stablehlo.add %0, %res : tensor<2x4xf32> loc("jit(f)/add")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(f)/ln/reduce_sum")
  %four = stablehlo.constant dense<4.000000e+00> : tensor<2xf32> loc("jit(f)/ln/div")
  %2 = stablehlo.reduce(%1 init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32> loc("jit(f)/ln/reduce_sum")
  %3 = stablehlo.divide %2, %four : tensor<2xf32> loc("jit(f)/ln/div")
  %4 = stablehlo.broadcast_in_dim %3, dims = [0] : (tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/ln/broadcast_in_dim")
  %5 = stablehlo.subtract %1, %4 : tensor<2x4xf32> loc("jit(f)/ln/sub")
  %6 = stablehlo.dot_general %5, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %6 : tensor<2x3xf32>
}

// -----

// A while carry between a dot in the body and a dot after the loop: the carry, the
// body's tanh and the loop's result are bf16; the initial value is converted once,
// outside the loop; the integer counter is untouched.
// CHECK-LABEL: func.func @while_carry
// CHECK-SAME:    (%[[H0:.*]]: tensor<2x4xf32>, %[[W:.*]]: tensor<4x4xf32>) -> tensor<2x4xf32>
// CHECK:         %[[H016:.*]] = stablehlo.convert %[[H0]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[L:.*]]:2 = stablehlo.while(%[[I:.*]] = %{{.*}}, %[[H:.*]] = %[[H016]]) : tensor<i32>, tensor<2x4xbf16>
// CHECK:         stablehlo.compare LT, %[[I]], %{{.*}}, SIGNED
// CHECK:         %[[D:.*]] = stablehlo.dot_general %[[H]], %{{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[T:.*]] = stablehlo.tanh %[[D]] : tensor<2x4xbf16>
// CHECK:         stablehlo.return %{{.*}}, %[[T]] : tensor<i32>, tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[L]]#1, {{.*}} : (tensor<2x4xbf16>, tensor<4x4xbf16>) -> tensor<2x4xf32>
// CPU-LABEL:   func.func @while_carry
// CPU:           stablehlo.while({{.*}}) : tensor<i32>, tensor<2x4xbf16>
// CPU:           %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xf32>
// CPU:           %[[D16:.*]] = stablehlo.convert %[[D]] : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CPU:           stablehlo.tanh %[[D16]] : tensor<2x4xbf16>
func.func @while_carry(%h0: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32> loc("jit(f)/while")
  %r:2 = stablehlo.while(%i = %c0, %h = %h0) : tensor<i32>, tensor<2x4xf32>
  cond {
    %c3 = stablehlo.constant dense<3> : tensor<i32> loc("jit(f)/while/cond")
    %p = stablehlo.compare LT, %i, %c3, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1> loc("jit(f)/while/cond/lt")
    stablehlo.return %p : tensor<i1> loc("jit(f)/while/cond")
  } do {
    %d = stablehlo.dot_general %h, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/while/body/cell/dot_general")
    %t = stablehlo.tanh %d : tensor<2x4xf32> loc("jit(f)/while/body/cell/tanh")
    %c1 = stablehlo.constant dense<1> : tensor<i32> loc("jit(f)/while/body")
    %i1 = stablehlo.add %i, %c1 : tensor<i32> loc("jit(f)/while/body/add")
    stablehlo.return %i1, %t : tensor<i32>, tensor<2x4xf32> loc("jit(f)/while/body")
  } loc("jit(f)/while")
  %o = stablehlo.dot_general %r#1, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/head/dot_general")
  return %o : tensor<2x4xf32>
}

// -----

// JAX's bf16 sum idiom (convert up, f32 reduce, convert down) stays as written; the
// tanh before it, read only by the idiom's bf16 convert, runs in bf16.
// CHECK-LABEL: func.func @bf16_sum_idiom
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[T:.*]] = stablehlo.tanh %[[D]] : tensor<2x4xbf16>
// CHECK:         %[[U:.*]] = stablehlo.convert %[[T]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         %[[S:.*]] = stablehlo.reduce(%[[U]] init: %{{.*}}) applies stablehlo.add {{.*}} : (tensor<2x4xf32>, tensor<f32>) -> tensor<f32>
// CHECK:         %[[S16:.*]] = stablehlo.convert %[[S]] : (tensor<f32>) -> tensor<bf16>
// CHECK:         return %[[S16]] : tensor<bf16>
func.func @bf16_sum_idiom(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<bf16> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = stablehlo.tanh %0 : tensor<2x4xf32> loc("jit(f)/tanh")
  %2 = stablehlo.convert %1 : (tensor<2x4xf32>) -> tensor<2x4xbf16> loc("jit(f)/convert_element_type")
  %3 = stablehlo.convert %2 : (tensor<2x4xbf16>) -> tensor<2x4xf32> loc("jit(f)/reduce_sum")
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32> loc("jit(f)/reduce_sum")
  %4 = stablehlo.reduce(%3 init: %zero) applies stablehlo.add across dimensions = [0, 1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<f32> loc("jit(f)/reduce_sum")
  %5 = stablehlo.convert %4 : (tensor<f32>) -> tensor<bf16> loc("jit(f)/reduce_sum")
  return %5 : tensor<bf16>
}

// -----

// A private function called from a region and from f32 code is cloned per painting;
// the public signature never changes.
// CHECK-LABEL: func.func @calls
// CHECK-SAME:    -> (tensor<2x4xf32>, tensor<2x4xf32>)
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[A:.*]] = call @act(%[[D]]) : (tensor<2x4xbf16>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[A]], {{.*}} -> tensor<2x4xf32>
// CHECK:         call @act_mixed0(%{{.*}}) : (tensor<2x4xf32>) -> tensor<2x4xf32>
// CHECK-LABEL: func.func private @act(
// CHECK-SAME:    %{{.*}}: tensor<2x4xbf16>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.tanh %{{.*}} : tensor<2x4xbf16>
// CHECK-LABEL: func.func private @act_mixed0(
// CHECK-SAME:    %{{.*}}: tensor<2x4xf32>) -> tensor<2x4xf32>
// CHECK:         stablehlo.tanh %{{.*}} : tensor<2x4xf32>
func.func @calls(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = call @act(%0) : (tensor<2x4xf32>) -> tensor<2x4xf32> loc("jit(f)/act")
  %2 = stablehlo.dot_general %1, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %3 = call @act(%x) : (tensor<2x4xf32>) -> tensor<2x4xf32> loc("jit(f)/act")
  return %2, %3 : tensor<2x4xf32>, tensor<2x4xf32>
}
func.func private @act(%a: tensor<2x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.tanh %a : tensor<2x4xf32> loc("tanh")
  return %0 : tensor<2x4xf32>
}

// -----

// A boundary on the way out: the tanh between the dots is bf16; the multiply that also
// reads it leads only to the f32 return, so it stays f32 and reads the tanh converted
// back up (one convert, shared by both of its uses).
// CHECK-LABEL: func.func @converted_back
// CHECK:         %[[T:.*]] = stablehlo.tanh %{{.*}} : tensor<2x4xbf16>
// CHECK:         %[[D:.*]] = stablehlo.dot_general %[[T]], {{.*}} -> tensor<2x4xf32>
// CHECK:         %[[UP:.*]] = stablehlo.convert %[[T]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK-NOT:     stablehlo.convert
// CHECK:         %[[M:.*]] = stablehlo.multiply %[[UP]], %[[UP]] : tensor<2x4xf32>
// CHECK:         return %[[D]], %[[M]]
func.func @converted_back(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xf32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = stablehlo.tanh %0 : tensor<2x4xf32> loc("jit(f)/tanh")
  %2 = stablehlo.dot_general %1, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %3 = stablehlo.multiply %1, %1 : tensor<2x4xf32> loc("jit(f)/mul")
  return %2, %3 : tensor<2x4xf32>, tensor<2x4xf32>
}

// -----

// A case between two dots: both branches' results and the case result are bf16 (a
// link like a loop carry); the integer index is untouched.
// CHECK-LABEL: func.func @case_result
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[C:.*]] = "stablehlo.case"(%{{.*}}) ({
// CHECK:           %[[T:.*]] = stablehlo.tanh %[[D]] : tensor<2x4xbf16>
// CHECK:           stablehlo.return %[[T]] : tensor<2x4xbf16>
// CHECK:         }, {
// CHECK:           %[[N:.*]] = stablehlo.negate %[[D]] : tensor<2x4xbf16>
// CHECK:           stablehlo.return %[[N]] : tensor<2x4xbf16>
// CHECK:         }) : (tensor<i32>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[C]], {{.*}} -> tensor<2x4xf32>
func.func @case_result(%i: tensor<i32>, %x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> tensor<2x4xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = "stablehlo.case"(%i) ({
    %t = stablehlo.tanh %0 : tensor<2x4xf32> loc("jit(f)/cond/branch_0_fun/tanh")
    stablehlo.return %t : tensor<2x4xf32> loc("jit(f)/cond")
  }, {
    %n = stablehlo.negate %0 : tensor<2x4xf32> loc("jit(f)/cond/branch_1_fun/neg")
    stablehlo.return %n : tensor<2x4xf32> loc("jit(f)/cond")
  }) : (tensor<i32>) -> tensor<2x4xf32> loc("jit(f)/cond")
  %2 = stablehlo.dot_general %1, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  return %2 : tensor<2x4xf32>
}

// -----

// An add scatter whose indices name one position (the gradient of take_along_axis) is one
// add per element, not a sum: painted between the dots. One whose updates may meet (two
// positions, an embedding's gradient) is a sum: f32, converting its own inputs.
// CHECK-LABEL: func.func @scatter_one_position
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[S:.*]] = "stablehlo.scatter"(%[[D]], %{{.*}}, %{{.*}})
// CHECK:         stablehlo.add %{{.*}}, %{{.*}} : tensor<bf16>
// CHECK:         (tensor<2x4xbf16>, tensor<1xi32>, tensor<2xbf16>) -> tensor<2x4xbf16>
// CHECK:         stablehlo.dot_general %[[S]], {{.*}} -> tensor<2x3xf32>
// CHECK-LABEL: func.func @scatter_two_positions
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<2x4xbf16>
// CHECK:         %[[D32:.*]] = stablehlo.convert %[[D]] : (tensor<2x4xbf16>) -> tensor<2x4xf32>
// CHECK:         "stablehlo.scatter"(%[[D32]], %{{.*}}, %{{.*}})
// CHECK:         (tensor<2x4xf32>, tensor<2x1xi32>, tensor<2x2xf32>) -> tensor<2x4xf32>
func.func @scatter_one_position(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %i: tensor<1xi32>, %u: tensor<2xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = "stablehlo.scatter"(%0, %i, %u) <{indices_are_sorted = true, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [0], inserted_window_dims = [1], scatter_dims_to_operand_dims = [1]>, unique_indices = true}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<2x4xf32>, tensor<1xi32>, tensor<2xf32>) -> tensor<2x4xf32> loc("jit(f)/scatter-add")
  %2 = stablehlo.dot_general %1, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %2 : tensor<2x3xf32>
}
func.func @scatter_two_positions(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %i: tensor<2x1xi32>, %u: tensor<2x2xf32>, %w2: tensor<4x3xf32>) -> tensor<2x3xf32> {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/dot_general")
  %1 = "stablehlo.scatter"(%0, %i, %u) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [0], inserted_window_dims = [1], scatter_dims_to_operand_dims = [1], index_vector_dim = 1>, unique_indices = false}> ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %s = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %s : tensor<f32>
  }) : (tensor<2x4xf32>, tensor<2x1xi32>, tensor<2x2xf32>) -> tensor<2x4xf32> loc("jit(f)/scatter-add")
  %2 = stablehlo.dot_general %1, %w2, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32> loc("jit(f)/dot_general")
  return %2 : tensor<2x3xf32>
}

// -----

// A weight gradient as JAX's dot transpose writes it: a dot, then a transpose, read by
// the f32 optimizer. On GPU the transpose moves the 16-bit result and the convert comes
// after it (XLA folds a transpose that directly follows a dot into the GEMM); with
// keep_f32_results and on CPU the dot keeps its f32 result.
// CHECK-LABEL: func.func @weight_grad_transpose
// CHECK:         %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<3x4xbf16>
// CHECK:         %[[T:.*]] = stablehlo.transpose %[[D]], dims = [1, 0] : (tensor<3x4xbf16>) -> tensor<4x3xbf16>
// CHECK:         %[[T32:.*]] = stablehlo.convert %[[T]] : (tensor<4x3xbf16>) -> tensor<4x3xf32>
// CHECK:         stablehlo.multiply %[[T32]], %{{.*}} : tensor<4x3xf32>
// KEEP-LABEL:    func.func @weight_grad_transpose
// KEEP:          %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<3x4xf32>
// KEEP:          stablehlo.transpose %[[D]], dims = [1, 0] : (tensor<3x4xf32>) -> tensor<4x3xf32>
// CPU-LABEL:     func.func @weight_grad_transpose
// CPU:           %[[D:.*]] = stablehlo.dot_general {{.*}} -> tensor<3x4xf32>
// CPU:           stablehlo.transpose %[[D]], dims = [1, 0] : (tensor<3x4xf32>) -> tensor<4x3xf32>
func.func @weight_grad_transpose(%x: tensor<2x4xf32>, %dy: tensor<2x3xf32>, %m: tensor<4x3xf32>) -> tensor<4x3xf32> {
  %0 = stablehlo.dot_general %dy, %x, contracting_dims = [0] x [0] : (tensor<2x3xf32>, tensor<2x4xf32>) -> tensor<3x4xf32> loc("jit(f)/transpose(jvp())/dot_general")
  %1 = stablehlo.transpose %0, dims = [1, 0] : (tensor<3x4xf32>) -> tensor<4x3xf32> loc("jit(f)/transpose(jvp())/transpose")
  %2 = stablehlo.multiply %1, %m : tensor<4x3xf32> loc("jit(f)/mul")
  return %2 : tensor<4x3xf32>
}

// -----

// The logits gradient: f32 after a deny op (exp), read by a matrix op and by a sum (the
// bias gradient) only. On GPU computed in f32 and rounded once; the dot and the sum read
// that one 16-bit copy, the sum through a barrier (XLA:GPU would fold its convert back
// to f32 and keep the f32 value for it). TPU and no target: the sum reads the f32
// value (XLA:TPU fuses the convert into the dot). On the CPU target the deny op pins.
// GPU-LABEL:   func.func @sum_reads_the_16bit_copy
// GPU:         %[[D:.*]] = stablehlo.add %{{.*}}, %{{.*}} : tensor<8x32xf32>
// GPU-NEXT:    %[[LOW:.*]] = stablehlo.convert %[[D]] : (tensor<8x32xf32>) -> tensor<8x32xbf16>
// GPU-NEXT:    %[[KEPT:.*]] = stablehlo.optimization_barrier %[[LOW]] : tensor<8x32xbf16>
// GPU-NEXT:    %[[WIDE:.*]] = stablehlo.convert %[[KEPT]] : (tensor<8x32xbf16>) -> tensor<8x32xf32>
// GPU-NOT:     stablehlo.convert %[[D]]
// GPU-DAG:     stablehlo.dot_general %{{.*}}, %[[KEPT]]
// GPU-DAG:     stablehlo.reduce(%[[WIDE]] init:
// CHECK-LABEL: func.func @sum_reads_the_16bit_copy
// CHECK-NOT:   stablehlo.optimization_barrier
// CHECK:       stablehlo.reduce(%{{.*}} init:
// CHECK-SAME:  (tensor<8x32xf32>, tensor<f32>)
// TPU-LABEL:   func.func @sum_reads_the_16bit_copy
// TPU-NOT:     stablehlo.optimization_barrier
// TPU:         stablehlo.reduce(%{{.*}} init:
// TPU-SAME:    (tensor<8x32xf32>, tensor<f32>)
// CPU-LABEL:     func.func @sum_reads_the_16bit_copy
// CPU-NOT:       stablehlo.optimization_barrier
// CPU:           stablehlo.reduce(%{{.*}} init:
// CPU-SAME:      (tensor<8x32xf32>, tensor<f32>)
func.func @sum_reads_the_16bit_copy(%l: tensor<8x32xf32>, %h: tensor<8x16xf32>) -> (tensor<16x32xf32>, tensor<32xf32>) {
  %e = stablehlo.exponential %l : tensor<8x32xf32>
  %d = stablehlo.add %e, %l : tensor<8x32xf32>
  %dw = stablehlo.dot_general %h, %d, contracting_dims = [0] x [0] : (tensor<8x16xf32>, tensor<8x32xf32>) -> tensor<16x32xf32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %db = stablehlo.reduce(%d init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x32xf32>, tensor<f32>) -> tensor<32xf32>
  return %dw, %db : tensor<16x32xf32>, tensor<32xf32>
}

// -----

// Another f32 op (exp) reads the value too: XLA keeps it in f32 anyway, so the sum
// reads it as it is.
// GPU-LABEL: func.func @sum_and_another_f32_reader
// GPU-NOT:     stablehlo.optimization_barrier
// GPU:         stablehlo.reduce(%{{.*}} init:
// GPU-SAME:    (tensor<8x32xf32>, tensor<f32>)
func.func @sum_and_another_f32_reader(%l: tensor<8x32xf32>, %h: tensor<8x16xf32>) -> (tensor<16x32xf32>, tensor<32xf32>, tensor<8x32xf32>) {
  %e = stablehlo.exponential %l : tensor<8x32xf32>
  %d = stablehlo.add %e, %l : tensor<8x32xf32>
  %dw = stablehlo.dot_general %h, %d, contracting_dims = [0] x [0] : (tensor<8x16xf32>, tensor<8x32xf32>) -> tensor<16x32xf32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %db = stablehlo.reduce(%d init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x32xf32>, tensor<f32>) -> tensor<32xf32>
  %e2 = stablehlo.exponential %d : tensor<8x32xf32>
  return %dw, %db, %e2 : tensor<16x32xf32>, tensor<32xf32>, tensor<8x32xf32>
}

// -----

// The same value as a call's second result (a link, not an op): left as it is (the
// barrier goes after ops only; the call's first result, returned, keeps its f32 value).
// GPU-LABEL: func.func @sum_reads_a_call_result
// GPU-NOT:     stablehlo.optimization_barrier
// GPU:         return %[[R:.*]]#0,
// GPU-SAME:    tensor<8x32xf32>, tensor<16x32xf32>, tensor<32xf32>
func.func @sum_reads_a_call_result(%l: tensor<8x32xf32>, %h: tensor<8x16xf32>) -> (tensor<8x32xf32>, tensor<16x32xf32>, tensor<32xf32>) {
  %r:2 = call @logits_grad(%l) : (tensor<8x32xf32>) -> (tensor<8x32xf32>, tensor<8x32xf32>)
  %dw = stablehlo.dot_general %h, %r#1, contracting_dims = [0] x [0] : (tensor<8x16xf32>, tensor<8x32xf32>) -> tensor<16x32xf32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %db = stablehlo.reduce(%r#1 init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<8x32xf32>, tensor<f32>) -> tensor<32xf32>
  return %r#0, %dw, %db : tensor<8x32xf32>, tensor<16x32xf32>, tensor<32xf32>
}
func.func private @logits_grad(%l: tensor<8x32xf32>) -> (tensor<8x32xf32>, tensor<8x32xf32>) {
  %e = stablehlo.exponential %l : tensor<8x32xf32>
  %d = stablehlo.add %e, %l : tensor<8x32xf32>
  return %l, %d : tensor<8x32xf32>, tensor<8x32xf32>
}

// -----

// jax's gradient of maximum asks whether an operand is the result: the maximum is
// painted (between two matrix ops) from the operand rounded, so the equality test rounds
// it too (it compared the unrounded f32 %b with the result converted up: never equal,
// and the gradient to %b was lost). An ordering compare still reads f32 operands.
// CHECK-LABEL: func.func @equality_with_a_painted_result
// CHECK:         %[[B16:.*]] = stablehlo.convert %arg2 : (tensor<2x4xf32>) -> tensor<2x4xbf16>
// CHECK:         %[[M:.*]] = stablehlo.maximum %{{.*}}, %[[B16]] : tensor<2x4xbf16>
// CHECK:         stablehlo.compare EQ, %[[B16]], %[[M]], FLOAT : (tensor<2x4xbf16>, tensor<2x4xbf16>)
// CHECK:         stablehlo.compare GT, %{{.*}}, %{{.*}}, FLOAT : (tensor<2x4xf32>, tensor<2x4xf32>)
func.func @equality_with_a_painted_result(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %b: tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<2x4xi1>, tensor<2x4xi1>) {
  %d = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  %m = stablehlo.maximum %d, %b : tensor<2x4xf32>
  %e = stablehlo.dot_general %m, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32>
  %c = stablehlo.compare EQ, %b, %m, FLOAT : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xi1>
  %g = stablehlo.compare GT, %b, %m, FLOAT : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<2x4xi1>
  return %e, %c, %g : tensor<2x4xf32>, tensor<2x4xi1>, tensor<2x4xi1>
}
