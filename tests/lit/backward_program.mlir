// A backward program split from its forward (jax.grad of a compiled function runs two
// programs: runtime/amp_call.py). The runtime marks the arguments that carry the incoming
// gradient and hands over the forward's first and last matrix ops (ir/program_hints.py);
// rewritten with them, the program follows the fp8 recipe of the whole train step: the
// gradient is e5m2, the head's backward dots stay bf16. The marks are gone after.
//
// RUN: hlo-amp-opt %s --policy fp8 | filecheck %s --enable-var-scope
// Without the marks the same program quantised every gradient to e4m3fn and ran the
// head's backward dots in fp8.
// RUN: sed -e 's/{hlo_amp.incoming_gradient}//' -e 's/attributes {hlo_amp.forward_ends.*]]} //' %s \
// RUN:   | hlo-amp-opt --policy fp8 | filecheck %s --check-prefix=UNMARKED

// CHECK-LABEL: func.func public @main
// CHECK-NOT:     hlo_amp.
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x64xbf16>, tensor<32x16xbf16>) -> tensor<64x16xf32>
// CHECK:         stablehlo.dot_general {{.*}} : (tensor<32x16xbf16>, tensor<64x16xbf16>) -> tensor<32x64x{{bf16|f32}}>
// CHECK:         %[[G:.*]] = stablehlo.convert %{{.*}} : (tensor<32x64xf32>) -> tensor<32x64xf8E5M2>
// CHECK:         stablehlo.dot_general %{{.*}}, %[[G]], {{.*}} : (tensor<32x64xf8E4M3FN>, tensor<32x64xf8E5M2>) -> tensor<64x64xf32>
// CHECK-NOT:     hlo_amp.
// UNMARKED-LABEL: func.func public @main
// UNMARKED-NOT:  xf8E5M2>
// UNMARKED:      stablehlo.dot_general {{.*}} : (tensor<32x64xf8E4M3FN>, tensor<32x16xf8E4M3FN>) -> tensor<64x16xf32>
// UNMARKED-NOT:  xf8E5M2>
// UNMARKED:      return
module attributes {hlo_amp.forward_ends = [["head", "dot_general", "loc(\22model.py\22:12:8)", "last_matrix_op"]]} {
  func.func public @main(%h: tensor<32x64xf32>, %w_head: tensor<64x16xf32>, %t: tensor<32x64xf32>, %ct: tensor<32x16xf32> {hlo_amp.incoming_gradient}) -> (tensor<64x16xf32>, tensor<64x64xf32>) {
    %dw_head = stablehlo.dot_general %h, %ct, contracting_dims = [0] x [0] : (tensor<32x64xf32>, tensor<32x16xf32>) -> tensor<64x16xf32> loc(#head)
    %dh = stablehlo.dot_general %ct, %w_head, contracting_dims = [1] x [1] : (tensor<32x16xf32>, tensor<64x16xf32>) -> tensor<32x64xf32> loc(#head)
    %g = stablehlo.multiply %dh, %t : tensor<32x64xf32> loc(#mid_mul)
    %dw_mid = stablehlo.dot_general %h, %g, contracting_dims = [0] x [0] : (tensor<32x64xf32>, tensor<32x64xf32>) -> tensor<64x64xf32> loc(#mid)
    return %dw_head, %dw_mid : tensor<64x16xf32>, tensor<64x64xf32>
  }
}
#head = loc("jit(f)/transpose(jvp(head))/dot_general"("model.py":12:8))
#mid = loc("jit(f)/transpose(jvp(mid))/dot_general"("model.py":11:8))
#mid_mul = loc("jit(f)/transpose(jvp(mid))/mul"("model.py":11:4))
