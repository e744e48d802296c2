// The amaxes delayed scaling records (hlo-amp-batch-amax): the pieces of a recorded
// vector that are amaxes of tensors with the same row count and type are reduced
// together, each tensor first split into rows (reshape, maximum per row), then one
// maximum per row of the stacked rows; each piece becomes a slice of it. Left alone: a
// tensor XLA reduces in one kernel anyway (16,384 elements or fewer), a tensor computed
// by a transpose (XLA would copy it to reduce its rows), an amax read by anything else.
// Second: the amaxes of the public function's arguments (known when the step starts) are
// reduced together at its top, and each becomes an element of that reduction.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-batch-amax \
// RUN:   | filecheck %s --enable-var-scope
// Idempotence: a second run changes nothing.
// RUN: hlo-amp-opt %s --split-input-file --pass hlo-amp-batch-amax \
// RUN:   | hlo-amp-opt --split-input-file --pass hlo-amp-batch-amax \
// RUN:   | filecheck %s --enable-var-scope

// CHECK-LABEL: func.func public @main
// CHECK-SAME:    (%[[X:[^:]*]]: tensor<64x512xbf16>, %[[Y:[^:]*]]: tensor<128x256xbf16>, %[[Z:[^:]*]]: tensor<128x128xf32>, %[[T:[^:]*]]: tensor<512x64xbf16>, %[[W:[^:]*]]: tensor<64x512xbf16>)
// CHECK:         %[[XS:.*]] = stablehlo.reshape %[[X]] : (tensor<64x512xbf16>) -> tensor<2x16384xbf16>
// CHECK:         %[[XA:.*]] = stablehlo.abs %[[XS]]
// CHECK:         %[[XR:.*]] = stablehlo.reduce(%[[XA]] init: %{{.*}}) applies stablehlo.maximum across dimensions = [1] : (tensor<2x16384xbf16>, tensor<bf16>) -> tensor<2xbf16>
// CHECK:         %[[XROW:.*]] = stablehlo.reshape %[[XR]] : (tensor<2xbf16>) -> tensor<1x2xbf16>
// CHECK:         %[[YS:.*]] = stablehlo.reshape %[[Y]] : (tensor<128x256xbf16>) -> tensor<2x16384xbf16>
// CHECK:         %[[YR:.*]] = stablehlo.reduce
// CHECK-SAME:      across dimensions = [1] : (tensor<2x16384xbf16>, tensor<bf16>) -> tensor<2xbf16>
// CHECK:         %[[YROW:.*]] = stablehlo.reshape %[[YR]] : (tensor<2xbf16>) -> tensor<1x2xbf16>
// The 128x128 tensor: one row already.
// CHECK:         %[[ZA:.*]] = stablehlo.abs %[[Z]] : tensor<128x128xf32>
// CHECK:         %[[ZR:.*]] = stablehlo.reduce(%[[ZA]] init: %{{.*}}) applies stablehlo.maximum across dimensions = [0, 1]
// CHECK:         %[[ZP:.*]] = stablehlo.reshape %[[ZR]] : (tensor<f32>) -> tensor<1xf32>
// The transposed tensor and the amax the function also returns: as they were.
// CHECK:         %[[TT:.*]] = stablehlo.transpose %[[T]]
// CHECK:         stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<64x512xbf16>, tensor<bf16>) -> tensor<bf16>
// CHECK:         %[[TP:.*]] = stablehlo.reshape %{{.*}} : (tensor<f32>) -> tensor<1xf32>
// CHECK:         %[[WA:.*]] = stablehlo.abs %[[W]]
// CHECK:         %[[WR:.*]] = stablehlo.reduce(%[[WA]] init: %{{.*}}) applies stablehlo.maximum across dimensions = [0, 1]
// CHECK:         %[[WC:.*]] = stablehlo.convert %[[WR]] : (tensor<bf16>) -> tensor<f32>
// CHECK:         %[[WP:.*]] = stablehlo.reshape %[[WC]] : (tensor<f32>) -> tensor<1xf32>
// CHECK:         %[[STACK:.*]] = stablehlo.concatenate %[[XROW]], %[[YROW]], dim = 0 : (tensor<1x2xbf16>, tensor<1x2xbf16>) -> tensor<2x2xbf16>
// CHECK:         %[[SA:.*]] = stablehlo.abs %[[STACK]]
// CHECK:         %[[BOTH:.*]] = stablehlo.reduce(%[[SA]] init: %{{.*}}) applies stablehlo.maximum across dimensions = [1] : (tensor<2x2xbf16>, tensor<bf16>) -> tensor<2xbf16>
// CHECK:         %[[BOTH32:.*]] = stablehlo.convert %[[BOTH]] : (tensor<2xbf16>) -> tensor<2xf32>
// CHECK:         %[[XP:.*]] = stablehlo.slice %[[BOTH32]] [0:1]
// CHECK:         %[[YP:.*]] = stablehlo.slice %[[BOTH32]] [1:2]
// CHECK:         %[[V:.*]] = stablehlo.concatenate %[[XP]], %[[ZP]], %[[YP]], %[[TP]], %[[WP]], dim = 0
// CHECK:         return %[[V]], %[[WC]]
func.func public @main(%x: tensor<64x512xbf16>, %y: tensor<128x256xbf16>, %z: tensor<128x128xf32>, %t: tensor<512x64xbf16>, %w: tensor<64x512xbf16>) -> (tensor<5xf32>, tensor<f32>) {
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<bf16>
  %zero32 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %ax = stablehlo.abs %x : tensor<64x512xbf16>
  %rx = stablehlo.reduce(%ax init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<64x512xbf16>, tensor<bf16>) -> tensor<bf16>
  %cx = stablehlo.convert %rx : (tensor<bf16>) -> tensor<f32>
  %px = stablehlo.reshape %cx : (tensor<f32>) -> tensor<1xf32>
  %ay = stablehlo.abs %y : tensor<128x256xbf16>
  %ry = stablehlo.reduce(%ay init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<128x256xbf16>, tensor<bf16>) -> tensor<bf16>
  %cy = stablehlo.convert %ry : (tensor<bf16>) -> tensor<f32>
  %py = stablehlo.reshape %cy : (tensor<f32>) -> tensor<1xf32>
  %az = stablehlo.abs %z : tensor<128x128xf32>
  %rz = stablehlo.reduce(%az init: %zero32) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<128x128xf32>, tensor<f32>) -> tensor<f32>
  %pz = stablehlo.reshape %rz : (tensor<f32>) -> tensor<1xf32>
  %tt = stablehlo.transpose %t, dims = [1, 0] : (tensor<512x64xbf16>) -> tensor<64x512xbf16>
  %at = stablehlo.abs %tt : tensor<64x512xbf16>
  %rt = stablehlo.reduce(%at init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<64x512xbf16>, tensor<bf16>) -> tensor<bf16>
  %ct = stablehlo.convert %rt : (tensor<bf16>) -> tensor<f32>
  %pt = stablehlo.reshape %ct : (tensor<f32>) -> tensor<1xf32>
  %aw = stablehlo.abs %w : tensor<64x512xbf16>
  %rw = stablehlo.reduce(%aw init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<64x512xbf16>, tensor<bf16>) -> tensor<bf16>
  %cw = stablehlo.convert %rw : (tensor<bf16>) -> tensor<f32>
  %pw = stablehlo.reshape %cw : (tensor<f32>) -> tensor<1xf32>
  %v = stablehlo.concatenate %px, %pz, %py, %pt, %pw, dim = 0 : (tensor<1xf32>, tensor<1xf32>, tensor<1xf32>, tensor<1xf32>, tensor<1xf32>) -> tensor<5xf32>
  return %v, %cw : tensor<5xf32>, tensor<f32>
}

// -----

// CHECK-LABEL: func.func public @main
// CHECK-SAME:    (%[[A:[^:]*]]: tensor<256x128xf32>, %[[B:[^:]*]]: tensor<128x256xf32>, %[[C:[^:]*]]: tensor<64x64xf32>
// CHECK:         %[[AS:.*]] = stablehlo.reshape %[[A]] : (tensor<256x128xf32>) -> tensor<2x16384xf32>
// CHECK:         %[[AB:.*]] = stablehlo.convert %[[AS]] : (tensor<2x16384xf32>) -> tensor<2x16384xbf16>
// CHECK:         %[[AR:.*]] = stablehlo.reduce(%{{.*}} init: %{{.*}}) applies stablehlo.maximum across dimensions = [1] : (tensor<2x16384xbf16>, tensor<bf16>) -> tensor<2xbf16>
// CHECK:         %[[AROW:.*]] = stablehlo.reshape %[[AR]] : (tensor<2xbf16>) -> tensor<1x2xbf16>
// CHECK:         %[[BS:.*]] = stablehlo.reshape %[[B]] : (tensor<128x256xf32>) -> tensor<2x16384xf32>
// CHECK:         %[[BROW:.*]] = stablehlo.reshape %{{.*}} : (tensor<2xbf16>) -> tensor<1x2xbf16>
// CHECK:         %[[STACK:.*]] = stablehlo.concatenate %[[AROW]], %[[BROW]], dim = 0
// CHECK:         %[[BOTH:.*]] = stablehlo.reduce
// CHECK-SAME:      across dimensions = [1] : (tensor<2x2xbf16>, tensor<bf16>) -> tensor<2xbf16>
// CHECK:         %[[AP:.*]] = stablehlo.slice %[[BOTH]] [0:1]
// CHECK:         %[[AMAX:.*]] = stablehlo.reshape %[[AP]] : (tensor<1xbf16>) -> tensor<bf16>
// CHECK:         %[[BP:.*]] = stablehlo.slice %[[BOTH]] [1:2]
// CHECK:         %[[BMAX:.*]] = stablehlo.reshape %[[BP]] : (tensor<1xbf16>) -> tensor<bf16>
// The scales read the elements; the arguments' own converts and amaxes are gone.
// CHECK:         %[[SA:.*]] = stablehlo.convert %[[AMAX]] : (tensor<bf16>) -> tensor<f32>
// CHECK:         %[[SB:.*]] = stablehlo.convert %[[BMAX]] : (tensor<bf16>) -> tensor<f32>
// CHECK-NOT:     stablehlo.convert %[[A]]
// CHECK-NOT:     stablehlo.convert %[[B]]
// The 64x64 argument: one row already.
// CHECK:         %[[CB:.*]] = stablehlo.convert %[[C]]
// CHECK:         %[[CR:.*]] = stablehlo.reduce
// CHECK-SAME:      across dimensions = [0, 1] : (tensor<64x64xbf16>, tensor<bf16>) -> tensor<bf16>
// CHECK:         return %[[SA]], %[[SB]], %[[CR]]
func.func public @main(%a: tensor<256x128xf32>, %b: tensor<128x256xf32>, %c: tensor<64x64xf32>, %x: tensor<4x8xf32>) -> (tensor<f32>, tensor<f32>, tensor<bf16>) {
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<bf16>
  %zero32 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %ab = stablehlo.convert %a : (tensor<256x128xf32>) -> tensor<256x128xbf16>
  %aa = stablehlo.abs %ab : tensor<256x128xbf16>
  %ra = stablehlo.reduce(%aa init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<256x128xbf16>, tensor<bf16>) -> tensor<bf16>
  %sa = stablehlo.convert %ra : (tensor<bf16>) -> tensor<f32>
  %bb = stablehlo.convert %b : (tensor<128x256xf32>) -> tensor<128x256xbf16>
  %ba = stablehlo.abs %bb : tensor<128x256xbf16>
  %rb = stablehlo.reduce(%ba init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<128x256xbf16>, tensor<bf16>) -> tensor<bf16>
  %sb = stablehlo.convert %rb : (tensor<bf16>) -> tensor<f32>
  %cb = stablehlo.convert %c : (tensor<64x64xf32>) -> tensor<64x64xbf16>
  %ca = stablehlo.abs %cb : tensor<64x64xbf16>
  %rc = stablehlo.reduce(%ca init: %zero) applies stablehlo.maximum across dimensions = [0, 1] : (tensor<64x64xbf16>, tensor<bf16>) -> tensor<bf16>
  return %sa, %sb, %rc : tensor<f32>, tensor<f32>, tensor<bf16>
}
