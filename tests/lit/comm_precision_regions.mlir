// reduce= (hlo-amp-comm-precision) reaches the dots a scanned layer or a called function
// holds: the shardings of the public function's arguments flow into stablehlo.while
// bodies (jax.lax.scan) and through func.call (closed_call, remat's checkpoint bodies,
// nested jax.jit), and those dots whose contracting dimension is sharded return the
// reduce dtype, as they do at top level (tests/lit/comm_precision.mlir).
// RUN: hlo-amp-opt %s --split-input-file --policy bf16,reduce=bfloat16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=REDUCE16
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16,reduce=float32 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=REDUCE32
// Without reduce=, the accurate mode's f32 results:
// RUN: hlo-amp-opt %s --split-input-file --policy bf16 | filecheck %s --enable-var-scope --check-prefix=BF16
// Idempotence:
// RUN: hlo-amp-opt %s --split-input-file --policy bf16,reduce=bfloat16 \
// RUN:   | hlo-amp-opt --split-input-file --policy bf16,reduce=bfloat16 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=REDUCE16
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16,reduce=float32 \
// RUN:   | hlo-amp-opt --split-input-file --policy mixed_bfloat16,reduce=float32 \
// RUN:   | filecheck %s --enable-var-scope --check-prefix=REDUCE32

// A scanned row-parallel layer: the stacked weight is sharded over "tp" on its input
// dimension (main's sdy.sharding), the loop slices one layer's weight, and the dot
// contracts the "tp"-sharded dimension of both x and the weight: the partitioner sums
// its partial results across "tp" inside the loop. The accumulator enters as zeros
// (axes unknown) and takes the axes the body gives it.
// REDUCE16-LABEL: func.func public @scanned
// REDUCE16:         stablehlo.while
// REDUCE16:         } do {
// REDUCE16:           %[[Y:.*]] = stablehlo.dot_general {{.*}} : (tensor<16x64xbf16>, tensor<64x32xbf16>) -> tensor<16x32xbf16>
// REDUCE16-NEXT:      %[[Y32:.*]] = stablehlo.convert %[[Y]] : (tensor<16x32xbf16>) -> tensor<16x32xf32>
// REDUCE16-NEXT:      stablehlo.add %{{.*}}, %[[Y32]] : tensor<16x32xf32>
// REDUCE32-LABEL: func.func public @scanned
// REDUCE32:         } do {
// REDUCE32:           %[[Y:.*]] = stablehlo.dot_general {{.*}} : (tensor<16x64xbf16>, tensor<64x32xbf16>) -> tensor<16x32xf32>
// REDUCE32-NEXT:      stablehlo.convert %[[Y]] : (tensor<16x32xf32>) -> tensor<16x32xbf16>
// BF16-LABEL: func.func public @scanned
// BF16:         } do {
// BF16:           stablehlo.dot_general {{.*}} : (tensor<16x64xbf16>, tensor<64x32xbf16>) -> tensor<16x32xf32>
// BF16-NOT:       stablehlo.convert {{.*}} -> tensor<16x32xbf16>
module @loop_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=4, "tp"=2]>
  func.func public @scanned(%x: tensor<16x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {"tp"}]>}, %w: tensor<2x64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"tp"}, {}]>}) -> tensor<16x32xf32> {
    %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %acc0 = stablehlo.broadcast_in_dim %zero, dims = [] : (tensor<f32>) -> tensor<16x32xf32>
    %i0 = stablehlo.constant dense<0> : tensor<i32>
    %out:4 = stablehlo.while(%i = %i0, %xs = %x, %ws = %w, %acc = %acc0) : tensor<i32>, tensor<16x64xf32>, tensor<2x64x32xf32>, tensor<16x32xf32>
    cond {
      %n = stablehlo.constant dense<2> : tensor<i32>
      %lt = stablehlo.compare LT, %i, %n, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    } do {
      %c0 = stablehlo.constant dense<0> : tensor<i32>
      %slice = stablehlo.dynamic_slice %ws, %i, %c0, %c0, sizes = [1, 64, 32] : (tensor<2x64x32xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1x64x32xf32>
      %wi = stablehlo.reshape %slice : (tensor<1x64x32xf32>) -> tensor<64x32xf32>
      %y = stablehlo.dot_general %xs, %wi, contracting_dims = [1] x [0] : (tensor<16x64xf32>, tensor<64x32xf32>) -> tensor<16x32xf32>
      %sum = stablehlo.add %acc, %y : tensor<16x32xf32>
      %one = stablehlo.constant dense<1> : tensor<i32>
      %next = stablehlo.add %i, %one : tensor<i32>
      stablehlo.return %next, %xs, %ws, %sum : tensor<i32>, tensor<16x64xf32>, tensor<2x64x32xf32>, tensor<16x32xf32>
    }
    return %out#3 : tensor<16x32xf32>
  }
}

// -----

// A private function called once with a row-parallel pair (x's and w's contracting
// dimension on "tp") is retyped; @shared is called with that pair and with a pair
// whose contracting dimension is not sharded: its one dot serves both calls, so it
// keeps the mode's result type.
// REDUCE16-LABEL: func.func private @row_parallel
// REDUCE16:         %[[Y:.*]] = stablehlo.dot_general {{.*}} -> tensor<16x32xbf16>
// REDUCE16-NEXT:    stablehlo.convert %[[Y]] : (tensor<16x32xbf16>) -> tensor<16x32xf32>
// REDUCE16-LABEL: func.func private @shared
// REDUCE16:         stablehlo.dot_general {{.*}} -> tensor<16x32xf32>
// REDUCE32-LABEL: func.func private @row_parallel
// REDUCE32:         %[[Y:.*]] = stablehlo.dot_general {{.*}} -> tensor<16x32xf32>
// REDUCE32-NEXT:    stablehlo.convert %[[Y]] : (tensor<16x32xf32>) -> tensor<16x32xbf16>
// REDUCE32-LABEL: func.func private @shared
// REDUCE32:         stablehlo.dot_general {{.*}} -> tensor<16x32xbf16>
// BF16-LABEL: func.func private @row_parallel
// BF16:         stablehlo.dot_general {{.*}} -> tensor<16x32xf32>
module @call_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=4, "tp"=2]>
  func.func public @called(%x: tensor<16x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {"tp"}]>}, %w: tensor<64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"tp"}, {}]>}, %v: tensor<64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {"tp"}]>}) -> (tensor<16x32xf32>, tensor<16x32xf32>, tensor<16x32xf32>) {
    %y = func.call @row_parallel(%x, %w) : (tensor<16x64xf32>, tensor<64x32xf32>) -> tensor<16x32xf32>
    %a = func.call @shared(%x, %w) : (tensor<16x64xf32>, tensor<64x32xf32>) -> tensor<16x32xf32>
    %xr = sdy.sharding_constraint %x <@mesh, [{"fsdp"}, {}]> : tensor<16x64xf32>
    %b = func.call @shared(%xr, %v) : (tensor<16x64xf32>, tensor<64x32xf32>) -> tensor<16x32xf32>
    return %y, %a, %b : tensor<16x32xf32>, tensor<16x32xf32>, tensor<16x32xf32>
  }
  func.func private @row_parallel(%x: tensor<16x64xf32>, %w: tensor<64x32xf32>) -> tensor<16x32xf32> {
    %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<16x64xf32>, tensor<64x32xf32>) -> tensor<16x32xf32>
    return %y : tensor<16x32xf32>
  }
  func.func private @shared(%x: tensor<16x64xf32>, %w: tensor<64x32xf32>) -> tensor<16x32xf32> {
    %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<16x64xf32>, tensor<64x32xf32>) -> tensor<16x32xf32>
    return %y : tensor<16x32xf32>
  }
}

// -----

// A case branch reads main's x and w directly (a row-parallel pair).
// REDUCE16-LABEL: func.func public @branched
// REDUCE16:         "stablehlo.case"
// REDUCE16:           %[[Y:.*]] = stablehlo.dot_general {{.*}} -> tensor<16x32xbf16>
// REDUCE16-NEXT:      stablehlo.convert %[[Y]] : (tensor<16x32xbf16>) -> tensor<16x32xf32>
// REDUCE32-LABEL: func.func public @branched
// REDUCE32:         "stablehlo.case"
// REDUCE32:           %[[Y:.*]] = stablehlo.dot_general {{.*}} -> tensor<16x32xf32>
// REDUCE32-NEXT:      stablehlo.convert %[[Y]] : (tensor<16x32xf32>) -> tensor<16x32xbf16>
// BF16-LABEL: func.func public @branched
// BF16:         stablehlo.dot_general {{.*}} -> tensor<16x32xf32>
module @case_module attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["fsdp"=4, "tp"=2]>
  func.func public @branched(%i: tensor<i32>, %x: tensor<16x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"fsdp"}, {"tp"}]>}, %w: tensor<64x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"tp"}, {}]>}) -> tensor<16x32xf32> {
    %r = "stablehlo.case"(%i) ({
      %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<16x64xf32>, tensor<64x32xf32>) -> tensor<16x32xf32>
      stablehlo.return %y : tensor<16x32xf32>
    }, {
      %z = stablehlo.constant dense<0.000000e+00> : tensor<16x32xf32>
      stablehlo.return %z : tensor<16x32xf32>
    }) : (tensor<i32>) -> tensor<16x32xf32>
    return %r : tensor<16x32xf32>
  }
}
