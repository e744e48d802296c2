// hlo-amp-opt --report writes every decision as JSON; the module still goes to -o.
// RUN: hlo-amp-opt %s --policy 'bf16,scope:head=float32,scope:never_used=keep' \
// RUN:   --report %t.json -o %t.mlir
// RUN: filecheck %s --input-file %t.json --check-prefix=JSON
// RUN: filecheck %s --input-file %t.mlir --check-prefix=MLIR
//
// With -o /dev/null only the report is of interest; --report - prints it on stderr.
// RUN: hlo-amp-opt %s --policy 'bf16,scope:head=float32,scope:never_used=keep' \
// RUN:   --report - -o /dev/null 2>&1 | filecheck %s --check-prefix=JSON

// JSON:      "policy": "bf16,compute=bfloat16,scope:head=float32,scope:never_used=keep",
// JSON-NEXT: "summary": "converted 2/4 ops; low precision: 1/2 dot_general, 1/1 dot, 0/1 convolution; {{[0-9]+}}% of FLOPs in 16-bit or narrower",
// JSON-NEXT: "decisions": [

// The forward dot in Block_0/attn: converted by the op rule.
// JSON:      "function": "main",
// JSON-NEXT: "op_kind": "dot_general",
// JSON-NEXT: "scope": "Block_0/attn",
// JSON-NEXT: "direction": "forward",
// JSON-NEXT: "operands_before": [
// JSON-NEXT:   "f32",
// JSON-NEXT:   "f32"
// JSON-NEXT: ],
// JSON-NEXT: "operands_after": [
// JSON-NEXT:   "bf16",
// JSON-NEXT:   "bf16"
// JSON-NEXT: ],
// JSON-NEXT: "result_before": "f32",
// JSON-NEXT: "result_after": "f32",
// JSON-NEXT: "action": "compute",
// JSON-NEXT: "rule": "op:dot_general",
// JSON-NEXT: "changed": true,
// JSON-NEXT: "reason": "bf16 operands, f32 accumulation",
// JSON-NEXT: "flops": 64,
// JSON-NEXT: "shape": "2x4",
// JSON-NEXT: "runs": 1,
// JSON-NEXT: "location": "jit(f)/jvp(Block_0)/attn/dot_general",

// The backward dot under head: the scope rule (float32) beats the op rule.
// JSON:      "scope": "head",
// JSON-NEXT: "direction": "backward",
// JSON:      "action": "float32",
// JSON-NEXT: "rule": "scope:head",
// JSON-NEXT: "changed": false,
// JSON-NEXT: "reason": "already float32",
// JSON:      "location": "jit(f)/transpose(jvp(head))/dot_general",

// stablehlo.dot has its own op kind and op rule.
// JSON:      "op_kind": "dot",
// JSON:      "rule": "op:dot",
// JSON-NEXT: "changed": true,

// A convolution in amp_stop is kept.
// JSON:      "op_kind": "convolution",
// JSON-NEXT: "scope": "amp_stop/conv1",
// JSON:      "action": "keep",
// JSON-NEXT: "rule": "amp_stop",
// JSON-NEXT: "changed": false,
// JSON-NEXT: "reason": "kept as written",
// JSON:      ],
// JSON-NEXT: "unused_rules": [
// JSON-NEXT:   "scope:never_used"
// JSON-NEXT: ],

// MLIR-LABEL: func.func @main
// MLIR-COUNT-2: stablehlo.convert
// MLIR:         stablehlo.dot_general {{.*}} -> tensor<2x4xf32>
// MLIR:         stablehlo.dot_general %arg2, %arg0, {{.*}} : (tensor<2x3xf32>, tensor<2x4xf32>) -> tensor<3x4xf32>
func.func @main(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>, %g: tensor<2x3xf32>, %v: tensor<4xf32>,
                %img: tensor<1x5x5x2xf32>, %k: tensor<3x3x2x4xf32>)
    -> (tensor<2x4xf32>, tensor<3x4xf32>, tensor<4xf32>, tensor<1x3x3x4xf32>) {
  %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("jit(f)/jvp(Block_0)/attn/dot_general")
  %1 = stablehlo.dot_general %g, %x, contracting_dims = [0] x [0] : (tensor<2x3xf32>, tensor<2x4xf32>) -> tensor<3x4xf32> loc("jit(f)/transpose(jvp(head))/dot_general")
  %2 = stablehlo.dot %v, %w : (tensor<4xf32>, tensor<4x4xf32>) -> tensor<4xf32> loc("jit(f)/dot")
  %3 = stablehlo.convolution(%img, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<1x5x5x2xf32>, tensor<3x3x2x4xf32>) -> tensor<1x3x3x4xf32> loc("jit(f)/amp_stop/conv1/conv_general_dilated")
  return %0, %1, %2, %3 : tensor<2x4xf32>, tensor<3x4xf32>, tensor<4xf32>, tensor<1x3x3x4xf32>
}
