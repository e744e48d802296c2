// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-cleanup | filecheck %s --enable-var-scope
// Idempotence: cleaning up cleaned-up output changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-cleanup \
// RUN:   | hlo-amp-opt --split-input-file --pass hlo-amp-cleanup | filecheck %s --enable-var-scope

// bf16 -> f32 -> bf16 gives back every value: both converts go.
// CHECK-LABEL: func.func @lossless_round_trip
// CHECK-SAME:    (%[[X:.*]]: tensor<4xbf16>)
// CHECK-NOT:     stablehlo.convert
// CHECK:         return %[[X]] : tensor<4xbf16>
func.func @lossless_round_trip(%x: tensor<4xbf16>) -> tensor<4xbf16> {
  %0 = stablehlo.convert %x : (tensor<4xbf16>) -> tensor<4xf32>
  %1 = stablehlo.convert %0 : (tensor<4xf32>) -> tensor<4xbf16>
  return %1 : tensor<4xbf16>
}

// -----

// f32 -> bf16 -> f32 rounds: the program's rounding must stay.
// CHECK-LABEL: func.func @lossy_round_trip
// CHECK:         %[[N:.*]] = stablehlo.convert %arg0 : (tensor<4xf32>) -> tensor<4xbf16>
// CHECK:         %[[W:.*]] = stablehlo.convert %[[N]] : (tensor<4xbf16>) -> tensor<4xf32>
// CHECK:         return %[[W]] : tensor<4xf32>
func.func @lossy_round_trip(%x: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xbf16>
  %1 = stablehlo.convert %0 : (tensor<4xbf16>) -> tensor<4xf32>
  return %1 : tensor<4xf32>
}

// -----

// f16 -> bf16 -> f16 is lossy both ways (range, then mantissa): kept.
// CHECK-LABEL: func.func @f16_through_bf16
// CHECK-COUNT-2: stablehlo.convert
// CHECK:         return
func.func @f16_through_bf16(%x: tensor<4xf16>) -> tensor<4xf16> {
  %0 = stablehlo.convert %x : (tensor<4xf16>) -> tensor<4xbf16>
  %1 = stablehlo.convert %0 : (tensor<4xbf16>) -> tensor<4xf16>
  return %1 : tensor<4xf16>
}

// -----

// Integer round trips are not float widenings: kept.
// CHECK-LABEL: func.func @int_round_trip
// CHECK:         %[[F:.*]] = stablehlo.convert %arg0 : (tensor<4xi32>) -> tensor<4xf32>
// CHECK:         %[[I:.*]] = stablehlo.convert %[[F]] : (tensor<4xf32>) -> tensor<4xi32>
// CHECK:         return %[[I]]
func.func @int_round_trip(%x: tensor<4xi32>) -> tensor<4xi32> {
  %0 = stablehlo.convert %x : (tensor<4xi32>) -> tensor<4xf32>
  %1 = stablehlo.convert %0 : (tensor<4xf32>) -> tensor<4xi32>
  return %1 : tensor<4xi32>
}

// -----

// A convert to the same type does nothing.
// CHECK-LABEL: func.func @identity
// CHECK-NOT:     stablehlo.convert
// CHECK:         return %arg0 : tensor<4xf32>
func.func @identity(%x: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

// Two converts of one value to one type in one block become one.
// CHECK-LABEL: func.func @duplicates
// CHECK:         %[[C:.*]] = stablehlo.convert %arg0 : (tensor<4xf32>) -> tensor<4xbf16>
// CHECK-NOT:     stablehlo.convert
// CHECK:         stablehlo.add %[[C]], %[[C]] : tensor<4xbf16>
func.func @duplicates(%x: tensor<4xf32>) -> tensor<4xbf16> {
  %0 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xbf16>
  %1 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xbf16>
  %2 = stablehlo.add %0, %1 : tensor<4xbf16>
  return %2 : tensor<4xbf16>
}

// -----

// Converts of one value to different types are different converts.
// CHECK-LABEL: func.func @different_targets
// CHECK:         %[[B:.*]] = stablehlo.convert %arg0 : (tensor<4xf32>) -> tensor<4xbf16>
// CHECK:         %[[H:.*]] = stablehlo.convert %arg0 : (tensor<4xf32>) -> tensor<4xf16>
// CHECK:         return %[[B]], %[[H]]
func.func @different_targets(%x: tensor<4xf32>) -> (tensor<4xbf16>, tensor<4xf16>) {
  %0 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xbf16>
  %1 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xf16>
  return %0, %1 : tensor<4xbf16>, tensor<4xf16>
}

// -----

// Unused converts are erased, and so is a convert that only fed them.
// CHECK-LABEL: func.func @dead_chain
// CHECK-NOT:     stablehlo.convert
// CHECK:         return %arg0 : tensor<4xf32>
func.func @dead_chain(%x: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xbf16>
  %1 = stablehlo.convert %0 : (tensor<4xbf16>) -> tensor<4xf16>
  return %x : tensor<4xf32>
}

// -----

// Converts in different blocks (the function body, each case branch) are not merged:
// a value made in one branch does not dominate the other.
// CHECK-LABEL: func.func @other_blocks
// CHECK:         %[[TOP:.*]] = stablehlo.convert %arg1 : (tensor<4xf32>) -> tensor<4xbf16>
// CHECK:         "stablehlo.case"
// CHECK:           %[[B0:.*]] = stablehlo.convert %arg1 : (tensor<4xf32>) -> tensor<4xbf16>
// CHECK:           stablehlo.return %[[B0]]
// CHECK:           %[[B1:.*]] = stablehlo.convert %arg1 : (tensor<4xf32>) -> tensor<4xbf16>
// CHECK:           stablehlo.return %[[B1]]
// CHECK:         return %[[TOP]],
func.func @other_blocks(%p: tensor<i32>, %x: tensor<4xf32>) -> (tensor<4xbf16>, tensor<4xbf16>) {
  %0 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xbf16>
  %r = "stablehlo.case"(%p) ({
    %1 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xbf16>
    stablehlo.return %1 : tensor<4xbf16>
  }, {
    %1 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xbf16>
    stablehlo.return %1 : tensor<4xbf16>
  }) : (tensor<i32>) -> tensor<4xbf16>
  return %0, %r : tensor<4xbf16>, tensor<4xbf16>
}

// -----

// Converts inside private functions are cleaned up too.
// CHECK-LABEL: func.func private @helper
// CHECK-NOT:     stablehlo.convert
// CHECK:         return %arg0 : tensor<4xbf16>
func.func @caller(%x: tensor<4xbf16>) -> tensor<4xbf16> {
  %0 = func.call @helper(%x) : (tensor<4xbf16>) -> tensor<4xbf16>
  return %0 : tensor<4xbf16>
}
func.func private @helper(%x: tensor<4xbf16>) -> tensor<4xbf16> {
  %0 = stablehlo.convert %x : (tensor<4xbf16>) -> tensor<4xf32>
  %1 = stablehlo.convert %0 : (tensor<4xf32>) -> tensor<4xbf16>
  return %1 : tensor<4xbf16>
}
