// Shared by the fused CPU kernels (see cross_entropy.cc, residual_norm.cc): bfloat16 <->
// float element access written so that g++ vectorizes the row loops, and row sharding over
// TensorFlow's intra-op threads. Inputs of type T are float or bfloat16; all arithmetic is
// float32.

#ifndef KERAS_TRANSFORMER_KERNELS_COMMON_H_
#define KERAS_TRANSFORMER_KERNELS_COMMON_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace keras_transformer {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;
using bf16 = Eigen::bfloat16;

// ---- element access: bfloat16 <-> float by bit manipulation, so loops vectorize ----------

inline float Load(const float* p, int64_t i) { return p[i]; }
inline float Load(const bf16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}
inline void Store(float* p, int64_t i, float value) { p[i] = value; }
inline void Store(bf16* p, int64_t i, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  const uint16_t rounded = static_cast<uint16_t>(bits >> 16);
  reinterpret_cast<uint16_t*>(p)[i] = nan ? uint16_t{0x7fc0} : rounded;
}

// Registers kernel class template `Op` for op `name` on the CPU in both supported dtypes.
#define KT_REGISTER_CPU_KERNELS(name, Op)                                                \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<float>("T"),   \
                          Op<float>);                                                  \
  REGISTER_KERNEL_BUILDER(Name(name).Device(DEVICE_CPU).TypeConstraint<bf16>("T"), Op<bf16>)

template <typename Work>
void ParallelRows(OpKernelContext* context, int64_t rows, int64_t cost_per_row, Work work) {
  const auto& workers = *context->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(workers.num_threads, workers.workers, rows, cost_per_row, work);
}

}  // namespace keras_transformer

#endif  // KERAS_TRANSFORMER_KERNELS_COMMON_H_
