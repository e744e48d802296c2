// The accurate mode on XLA:TPU, which runs an f32 dot at DEFAULT precision as one bf16
// pass (Target.f32_dot_runs_as): every such dot stays f32, the same arithmetic without a
// bf16 copy in the program (a shared one, as of the softmax backward's gradient that the
// dQ and dK dots read, is a copy XLA:TPU would store); dots that asked for HIGH precision
// (XLA:TPU's three-pass form) are converted as on every target. Without a target (and
// on GPU) all of them convert.
//
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy bf16 --target tpu \
// RUN:   | filecheck %s --check-prefix=TPU --enable-var-scope
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy bf16 --target gpu \
// RUN:   | filecheck %s --check-prefix=GPU --enable-var-scope
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy bf16 --target tpu \
// RUN:   --report - -o /dev/null 2>&1 | filecheck %s --check-prefix=REPORT
// The fast mode seeds its 16-bit regions from the converted dots: all converted.
// RUN: hlo-amp-opt %s --pass hlo-amp-insert-converts --policy mixed_bfloat16 --target tpu \
// RUN:   | filecheck %s --check-prefix=GPU --enable-var-scope

// TPU-LABEL: func.func @main
// TPU-SAME:    (%[[DS:[^:]*]]: tensor<8x8xf32>, %[[K:[^:]*]]: tensor<8x4xf32>, %[[Q:[^:]*]]: tensor<8x4xf32>, %[[W:[^:]*]]: tensor<4x4xf32>, %[[X:[^:]*]]: tensor<8x4xf32>, %[[V:[^:]*]]: tensor<4x4xf32>)
// TPU:         %[[S:.*]] = stablehlo.multiply %[[DS]], %[[DS]]
// TPU-NEXT:    %[[DQ:.*]] = stablehlo.dot_general %[[S]], %[[K]], {{.*}} : (tensor<8x8xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
// TPU-NEXT:    %[[DK:.*]] = stablehlo.dot_general %[[S]], %[[Q]], {{.*}} : (tensor<8x8xf32>, tensor<8x4xf32>) -> tensor<8x4xf32>
// TPU-NEXT:    stablehlo.dot_general %[[X]], %[[W]], {{.*}} : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
// TPU-NEXT:    %[[DQ16:.*]] = stablehlo.convert %[[DQ]] : (tensor<8x4xf32>) -> tensor<8x4xbf16>
// TPU-NEXT:    %[[V16:.*]] = stablehlo.convert %[[V]] : (tensor<4x4xf32>) -> tensor<4x4xbf16>
// TPU-NEXT:    stablehlo.dot_general %[[DQ16]], %[[V16]], {{.*}} precision = [HIGH, HIGH]
// TPU-SAME:      : (tensor<8x4xbf16>, tensor<4x4xbf16>) -> tensor<8x4xf32>
// TPU-NEXT:    stablehlo.dot_general %[[DQ16]], %[[V16]], {{.*}} precision = [HIGH, HIGH]
// TPU-SAME:      : (tensor<8x4xbf16>, tensor<4x4xbf16>) -> tensor<8x4xf32>

// GPU-LABEL: func.func @main
// GPU:         %[[S:.*]] = stablehlo.multiply
// GPU-NEXT:    %[[S16:.*]] = stablehlo.convert %[[S]] : (tensor<8x8xf32>) -> tensor<8x8xbf16>
// GPU:         stablehlo.dot_general %[[S16]], {{.*}} : (tensor<8x8xbf16>, tensor<8x4xbf16>) -> tensor<8x4xf32>
// GPU:         stablehlo.dot_general %[[S16]], {{.*}} : (tensor<8x8xbf16>, tensor<8x4xbf16>) -> tensor<8x4xf32>
// GPU:         stablehlo.dot_general {{.*}} : (tensor<8x4xbf16>, tensor<4x4xbf16>) -> tensor<8x4xf32>

// REPORT: kept f32: XLA:TPU rounds an f32 dot's operands to bf16 itself at DEFAULT precision (one bf16 matrix-unit pass, f32 accumulation)
// REPORT: kept f32: XLA:TPU rounds
// REPORT: kept f32: XLA:TPU rounds
// REPORT-NOT: kept f32: XLA:TPU rounds
func.func @main(%ds: tensor<8x8xf32>, %k: tensor<8x4xf32>, %q: tensor<8x4xf32>, %w: tensor<4x4xf32>, %x: tensor<8x4xf32>, %v: tensor<4x4xf32>) -> (tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>) {
  %s = stablehlo.multiply %ds, %ds : tensor<8x8xf32> loc("jit(f)/transpose(jvp(attn))/mul")
  %dq = stablehlo.dot_general %s, %k, contracting_dims = [1] x [0] : (tensor<8x8xf32>, tensor<8x4xf32>) -> tensor<8x4xf32> loc("jit(f)/transpose(jvp(attn))/dot_general")
  %dk = stablehlo.dot_general %s, %q, contracting_dims = [0] x [0] : (tensor<8x8xf32>, tensor<8x4xf32>) -> tensor<8x4xf32> loc("jit(f)/transpose(jvp(attn))/dot_general")
  %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(f)/mlp/dot_general")
  %h1 = stablehlo.dot_general %dq, %v, contracting_dims = [1] x [0], precision = [HIGH, HIGH] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(f)/pinned/dot_general")
  %h2 = stablehlo.dot_general %dq, %v, contracting_dims = [1] x [0], precision = [HIGH, HIGH] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32> loc("jit(f)/pinned/dot_general")
  return %dq, %dk, %y, %h1, %h2 : tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>
}
