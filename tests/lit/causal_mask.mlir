// Layers that share a private function of the causal mask (jnp.tril and jnp.where,
// lowered once and called by every layer) or one constant mask: the fast mode paints
// both calls the same way, so the shared function is rewritten once, not cloned and
// not rewritten twice (rewriting it a second time read converts the first rewrite had
// erased: a segfault on GPU and TPU, issue 33). Two layers, forward only; made by
// jax.jit(loss).lower(...).as_text() of
//   s = jnp.where(MASK, x @ w @ x.T, -1e9); x = x + jax.nn.softmax(s, -1) @ x
// with MASK = jnp.tril(jnp.ones((4, 4), bool)) in the first module and a numpy
// constant in the second.
//
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target gpu \
// RUN:   | filecheck %s --check-prefixes=LOW
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target tpu \
// RUN:   | filecheck %s --check-prefixes=LOW
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_bfloat16 --target cpu \
// RUN:   | filecheck %s --check-prefixes=CPU
// RUN: hlo-amp-opt %s --split-input-file --policy mixed_float16 --target gpu \
// RUN:   | filecheck %s --check-prefixes=F16

// Both layers' scores reach the mask's select in 16 bit through the one @_where.
// LOW-LABEL: module @tril_mask
// LOW: %[[M1:.*]] = call @tril(
// LOW: call @_where(%[[M1]], %{{.*}}, %{{.*}}) : (tensor<4x4xi1>, tensor<4x4xbf16>, tensor<f32>) -> tensor<4x4xbf16>
// LOW: %[[M2:.*]] = call @tril(
// LOW: call @_where(%[[M2]], %{{.*}}, %{{.*}}) : (tensor<4x4xi1>, tensor<4x4xbf16>, tensor<f32>) -> tensor<4x4xbf16>
// LOW: func.func private @tril(%arg0: tensor<4x4xi1>) -> tensor<4x4xi1>
// LOW: func.func private @_where(%arg0: tensor<4x4xi1>, %arg1: tensor<4x4xbf16>, %arg2: tensor<f32>) -> tensor<4x4xbf16>
// LOW-NEXT: stablehlo.convert %arg2 : (tensor<f32>) -> tensor<bf16>
// LOW: stablehlo.select %arg0, %arg1, %{{.*}} : tensor<4x4xi1>, tensor<4x4xbf16>
// LOW-NOT: func.func
// LOW: }
// On CPU a deny op (the softmax's exp) pins what it reads: the mask's select stays f32.
// CPU-LABEL: module @tril_mask
// CPU: call @_where(%{{.*}}, %{{.*}}, %{{.*}}) : (tensor<4x4xi1>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
// CPU: call @_where(%{{.*}}, %{{.*}}, %{{.*}}) : (tensor<4x4xi1>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
// CPU: func.func private @_where(%arg0: tensor<4x4xi1>, %arg1: tensor<4x4xf32>, %arg2: tensor<f32>) -> tensor<4x4xf32>
// CPU-NOT: func.func
// CPU: }
// Under f16 the fill -1e9 is beyond f16's range (it would be -inf, and a fully masked
// row's softmax NaN): the select reads the 16-bit scores converted up and stays f32.
// F16-LABEL: module @tril_mask
// F16: func.func private @_where(%arg0: tensor<4x4xi1>, %arg1: tensor<4x4xf16>, %arg2: tensor<f32>) -> tensor<4x4xf32>
// F16: stablehlo.convert %arg1 : (tensor<4x4xf16>) -> tensor<4x4xf32>
// F16: stablehlo.select %arg0, %{{.*}}, %{{.*}} : tensor<4x4xi1>, tensor<4x4xf32>
// F16-NOT: func.func
// F16: }

module @tril_mask attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<f32> {jax.result_info = "result"}) {
    %0 = stablehlo.dot_general %arg1, %arg0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = stablehlo.transpose %arg1, dims = [1, 0] : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.dot_general %0, %1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %c = stablehlo.constant dense<true> : tensor<i1>
    %3 = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<i1>) -> tensor<4x4xi1>
    %4 = call @tril(%3) : (tensor<4x4xi1>) -> tensor<4x4xi1>
    %cst = stablehlo.constant dense<-1.000000e+09> : tensor<f32>
    %5 = call @_where(%4, %2, %cst) : (tensor<4x4xi1>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %cst_0 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %6 = stablehlo.reduce(%5 init: %cst_0) applies stablehlo.maximum across dimensions = [1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %cst_1 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %7 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %8 = stablehlo.maximum %7, %6 : tensor<4xf32>
    %9 = stablehlo.broadcast_in_dim %8, dims = [0] : (tensor<4xf32>) -> tensor<4x1xf32>
    %10 = stablehlo.broadcast_in_dim %9, dims = [0, 1] : (tensor<4x1xf32>) -> tensor<4x4xf32>
    %11 = stablehlo.subtract %5, %10 : tensor<4x4xf32>
    %12 = stablehlo.exponential %11 : tensor<4x4xf32>
    %cst_2 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %13 = stablehlo.reduce(%12 init: %cst_2) applies stablehlo.add across dimensions = [1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %14 = stablehlo.broadcast_in_dim %13, dims = [0] : (tensor<4xf32>) -> tensor<4x1xf32>
    %15 = stablehlo.broadcast_in_dim %14, dims = [0, 1] : (tensor<4x1xf32>) -> tensor<4x4xf32>
    %16 = stablehlo.divide %12, %15 : tensor<4x4xf32>
    %17 = stablehlo.dot_general %16, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %18 = stablehlo.add %arg1, %17 : tensor<4x4xf32>
    %19 = stablehlo.dot_general %18, %arg0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %20 = stablehlo.transpose %18, dims = [1, 0] : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %21 = stablehlo.dot_general %19, %20, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %c_3 = stablehlo.constant dense<true> : tensor<i1>
    %22 = stablehlo.broadcast_in_dim %c_3, dims = [] : (tensor<i1>) -> tensor<4x4xi1>
    %23 = call @tril(%22) : (tensor<4x4xi1>) -> tensor<4x4xi1>
    %cst_4 = stablehlo.constant dense<-1.000000e+09> : tensor<f32>
    %24 = call @_where(%23, %21, %cst_4) : (tensor<4x4xi1>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %cst_5 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %25 = stablehlo.reduce(%24 init: %cst_5) applies stablehlo.maximum across dimensions = [1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %cst_6 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %26 = stablehlo.broadcast_in_dim %cst_6, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %27 = stablehlo.maximum %26, %25 : tensor<4xf32>
    %28 = stablehlo.broadcast_in_dim %27, dims = [0] : (tensor<4xf32>) -> tensor<4x1xf32>
    %29 = stablehlo.broadcast_in_dim %28, dims = [0, 1] : (tensor<4x1xf32>) -> tensor<4x4xf32>
    %30 = stablehlo.subtract %24, %29 : tensor<4x4xf32>
    %31 = stablehlo.exponential %30 : tensor<4x4xf32>
    %cst_7 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %32 = stablehlo.reduce(%31 init: %cst_7) applies stablehlo.add across dimensions = [1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %33 = stablehlo.broadcast_in_dim %32, dims = [0] : (tensor<4xf32>) -> tensor<4x1xf32>
    %34 = stablehlo.broadcast_in_dim %33, dims = [0, 1] : (tensor<4x1xf32>) -> tensor<4x4xf32>
    %35 = stablehlo.divide %31, %34 : tensor<4x4xf32>
    %36 = stablehlo.dot_general %35, %18, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %37 = stablehlo.add %18, %36 : tensor<4x4xf32>
    %38 = stablehlo.multiply %37, %37 : tensor<4x4xf32>
    %cst_8 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %39 = stablehlo.reduce(%38 init: %cst_8) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<f32>
    %cst_9 = stablehlo.constant dense<1.600000e+01> : tensor<f32>
    %40 = stablehlo.divide %39, %cst_9 : tensor<f32>
    return %40 : tensor<f32>
  }
  func.func private @tril(%arg0: tensor<4x4xi1>) -> tensor<4x4xi1> {
    %0 = stablehlo.iota dim = 0 : tensor<4x4xi32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    %1 = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<i32>) -> tensor<4x4xi32>
    %2 = stablehlo.add %0, %1 : tensor<4x4xi32>
    %3 = stablehlo.iota dim = 1 : tensor<4x4xi32>
    %4 = stablehlo.compare GE, %2, %3, SIGNED : (tensor<4x4xi32>, tensor<4x4xi32>) -> tensor<4x4xi1>
    %c_0 = stablehlo.constant dense<false> : tensor<i1>
    %5 = stablehlo.broadcast_in_dim %c_0, dims = [] : (tensor<i1>) -> tensor<4x4xi1>
    %6 = stablehlo.select %4, %arg0, %5 : tensor<4x4xi1>, tensor<4x4xi1>
    return %6 : tensor<4x4xi1>
  }
  func.func private @_where(%arg0: tensor<4x4xi1>, %arg1: tensor<4x4xf32>, %arg2: tensor<f32>) -> tensor<4x4xf32> {
    %0 = stablehlo.convert %arg2 : tensor<f32>
    %1 = stablehlo.broadcast_in_dim %0, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %2 = stablehlo.select %arg0, %arg1, %1 : tensor<4x4xi1>, tensor<4x4xf32>
    return %2 : tensor<4x4xf32>
  }
}

// -----

// One constant mask, read by both layers' calls of @_where.
// LOW-LABEL: module @constant_mask
// LOW: %[[MASK:.*]] = stablehlo.constant dense<{{\[\[}}true, false
// LOW: call @_where(%[[MASK]], %{{.*}}, %{{.*}}) : (tensor<4x4xi1>, tensor<4x4xbf16>, tensor<f32>) -> tensor<4x4xbf16>
// LOW: call @_where(%[[MASK]], %{{.*}}, %{{.*}}) : (tensor<4x4xi1>, tensor<4x4xbf16>, tensor<f32>) -> tensor<4x4xbf16>
// LOW: func.func private @_where(%arg0: tensor<4x4xi1>, %arg1: tensor<4x4xbf16>, %arg2: tensor<f32>) -> tensor<4x4xbf16>
// LOW-NOT: func.func
// LOW: }
// CPU-LABEL: module @constant_mask
// CPU: func.func private @_where(%arg0: tensor<4x4xi1>, %arg1: tensor<4x4xf32>, %arg2: tensor<f32>) -> tensor<4x4xf32>
// CPU-NOT: func.func
// CPU: }
// F16-LABEL: module @constant_mask
// F16: func.func private @_where(%arg0: tensor<4x4xi1>, %arg1: tensor<4x4xf16>, %arg2: tensor<f32>) -> tensor<4x4xf32>

module @constant_mask attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> (tensor<f32> {jax.result_info = "result"}) {
    %c = stablehlo.constant dense<[[true, false, false, false], [true, true, false, false], [true, true, true, false], [true, true, true, true]]> : tensor<4x4xi1>
    %0 = stablehlo.dot_general %arg1, %arg0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = stablehlo.transpose %arg1, dims = [1, 0] : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.dot_general %0, %1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %cst = stablehlo.constant dense<-1.000000e+09> : tensor<f32>
    %3 = call @_where(%c, %2, %cst) : (tensor<4x4xi1>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %cst_0 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %4 = stablehlo.reduce(%3 init: %cst_0) applies stablehlo.maximum across dimensions = [1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %cst_1 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %6 = stablehlo.maximum %5, %4 : tensor<4xf32>
    %7 = stablehlo.broadcast_in_dim %6, dims = [0] : (tensor<4xf32>) -> tensor<4x1xf32>
    %8 = stablehlo.broadcast_in_dim %7, dims = [0, 1] : (tensor<4x1xf32>) -> tensor<4x4xf32>
    %9 = stablehlo.subtract %3, %8 : tensor<4x4xf32>
    %10 = stablehlo.exponential %9 : tensor<4x4xf32>
    %cst_2 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %11 = stablehlo.reduce(%10 init: %cst_2) applies stablehlo.add across dimensions = [1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %12 = stablehlo.broadcast_in_dim %11, dims = [0] : (tensor<4xf32>) -> tensor<4x1xf32>
    %13 = stablehlo.broadcast_in_dim %12, dims = [0, 1] : (tensor<4x1xf32>) -> tensor<4x4xf32>
    %14 = stablehlo.divide %10, %13 : tensor<4x4xf32>
    %15 = stablehlo.dot_general %14, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %16 = stablehlo.add %arg1, %15 : tensor<4x4xf32>
    %17 = stablehlo.dot_general %16, %arg0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %18 = stablehlo.transpose %16, dims = [1, 0] : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %19 = stablehlo.dot_general %17, %18, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %cst_3 = stablehlo.constant dense<-1.000000e+09> : tensor<f32>
    %20 = call @_where(%c, %19, %cst_3) : (tensor<4x4xi1>, tensor<4x4xf32>, tensor<f32>) -> tensor<4x4xf32>
    %cst_4 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %21 = stablehlo.reduce(%20 init: %cst_4) applies stablehlo.maximum across dimensions = [1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %cst_5 = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %22 = stablehlo.broadcast_in_dim %cst_5, dims = [] : (tensor<f32>) -> tensor<4xf32>
    %23 = stablehlo.maximum %22, %21 : tensor<4xf32>
    %24 = stablehlo.broadcast_in_dim %23, dims = [0] : (tensor<4xf32>) -> tensor<4x1xf32>
    %25 = stablehlo.broadcast_in_dim %24, dims = [0, 1] : (tensor<4x1xf32>) -> tensor<4x4xf32>
    %26 = stablehlo.subtract %20, %25 : tensor<4x4xf32>
    %27 = stablehlo.exponential %26 : tensor<4x4xf32>
    %cst_6 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %28 = stablehlo.reduce(%27 init: %cst_6) applies stablehlo.add across dimensions = [1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %29 = stablehlo.broadcast_in_dim %28, dims = [0] : (tensor<4xf32>) -> tensor<4x1xf32>
    %30 = stablehlo.broadcast_in_dim %29, dims = [0, 1] : (tensor<4x1xf32>) -> tensor<4x4xf32>
    %31 = stablehlo.divide %27, %30 : tensor<4x4xf32>
    %32 = stablehlo.dot_general %31, %16, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %33 = stablehlo.add %16, %32 : tensor<4x4xf32>
    %34 = stablehlo.multiply %33, %33 : tensor<4x4xf32>
    %cst_7 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %35 = stablehlo.reduce(%34 init: %cst_7) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x4xf32>, tensor<f32>) -> tensor<f32>
    %cst_8 = stablehlo.constant dense<1.600000e+01> : tensor<f32>
    %36 = stablehlo.divide %35, %cst_8 : tensor<f32>
    return %36 : tensor<f32>
  }
  func.func private @_where(%arg0: tensor<4x4xi1>, %arg1: tensor<4x4xf32>, %arg2: tensor<f32>) -> tensor<4x4xf32> {
    %0 = stablehlo.convert %arg2 : tensor<f32>
    %1 = stablehlo.broadcast_in_dim %0, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %2 = stablehlo.select %arg0, %arg1, %1 : tensor<4x4xi1>, tensor<4x4xf32>
    return %2 : tensor<4x4xf32>
  }
}
