// 5.4 Label-smoothed cross-entropy as one C++ op forward and one backward (issue 6).
// Built by keras_transformer/kernels/__init__.py on first use.

#include "common.h"

namespace keras_transformer {
namespace {

// exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp), branch-free so that it vectorizes.
inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // a ternary (not std::max) vectorizes; NaN stays NaN
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, 4);
  return p * scale;
}

// ---- 5.4 label-smoothed cross-entropy ---------------------------------------------------
//
// Per row of logits x (V classes) with label y and smoothing eps:
//   lse = log sum exp(x);  loss = lse - (1 - eps) x[y] - eps mean(x)
//   d loss / d x = softmax(x) - (1 - eps) one_hot(y) - eps / V
// The forward pass keeps lse; the backward pass recomputes softmax from it while it scales
// by the upstream gradient, so the (rows, V) gradient is written once and never re-read.

REGISTER_OP("KtSmoothedCrossEntropy")
    .Input("logits: T")
    .Input("labels: int32")
    .Output("loss: float")
    .Output("log_normalizer: float")
    .Attr("T: {float, bfloat16}")
    .Attr("label_smoothing: float")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle rows;
      TF_RETURN_IF_ERROR(c->Subshape(c->input(0), 0, -1, &rows));
      TF_RETURN_IF_ERROR(c->Merge(rows, c->input(1), &rows));  // labels: the logits' rows
      c->set_output(0, rows);
      c->set_output(1, rows);
      return Status();
    });

REGISTER_OP("KtSmoothedCrossEntropyGrad")
    .Input("logits: T")
    .Input("labels: int32")
    .Input("log_normalizer: float")
    .Input("upstream: float")
    .Output("logits_gradient: T")
    .Attr("T: {float, bfloat16}")
    .Attr("label_smoothing: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return Status();
    });

// Checks shapes and labels; returns false (with the error set) when they are invalid.
Status CheckCrossEntropyInputs(const Tensor& logits, const Tensor& labels) {
  if (logits.dims() < 1) {
    return InvalidArgument("logits must have a class axis, got shape ",
                           logits.shape().DebugString());
  }
  const int64_t classes = logits.dim_size(logits.dims() - 1);
  TensorShape rows = logits.shape();
  rows.RemoveLastDims(1);
  if (labels.shape() != rows) {
    return InvalidArgument("labels ", labels.shape().DebugString(), " do not match logits ",
                           logits.shape().DebugString(), " without their class axis");
  }
  const auto flat = labels.flat<int32_t>();
  for (int64_t i = 0; i < flat.size(); ++i) {
    if (flat(i) < 0 || flat(i) >= classes) {
      return InvalidArgument("label ", flat(i), " at position ", i, " is outside [0, ",
                             classes, "): the labels do not fit the vocabulary");
    }
  }
  return Status();
}

// Rows [begin, end) of the forward pass (restrict pointers, not lambda captures, so that
// g++ vectorizes: see ResidualNormRows).
template <typename T>
void CrossEntropyRows(const T* __restrict x, const int32_t* __restrict labels, float eps,
                      int64_t classes, int64_t begin, int64_t end, float* __restrict loss,
                      float* __restrict log_normalizers) {
  for (int64_t row = begin; row < end; ++row) {
    const T* __restrict r = x + row * classes;
    float maximum = -INFINITY;
#pragma omp simd reduction(max : maximum)
    for (int64_t j = 0; j < classes; ++j) {
      const float v = Load(r, j);
      maximum = v > maximum ? v : maximum;  // a ternary, not std::max, vectorizes
    }
    float total = 0.0f, sum = 0.0f;
#pragma omp simd reduction(+ : total, sum)
    for (int64_t j = 0; j < classes; ++j) {
      const float v = Load(r, j);
      total += ExpNonPositive(v - maximum);
      sum += v;
    }
    const float log_normalizer = maximum + std::log(total);
    log_normalizers[row] = log_normalizer;
    const float uniform_term = eps > 0.0f ? eps * sum / static_cast<float>(classes) : 0.0f;
    loss[row] = log_normalizer - (1.0f - eps) * Load(r, labels[row]) - uniform_term;
  }
}

// Rows [begin, end) of the gradient, scaled by the upstream gradient of each row.
template <typename T>
void CrossEntropyGradRows(const T* __restrict x, const int32_t* __restrict labels,
                          const float* __restrict log_normalizers,
                          const float* __restrict upstream, float eps, int64_t classes,
                          int64_t begin, int64_t end, T* __restrict gradient) {
  const float uniform = eps / static_cast<float>(classes);
  for (int64_t row = begin; row < end; ++row) {
    const T* __restrict r = x + row * classes;
    T* __restrict g = gradient + row * classes;
    const float scale = upstream[row];
    const float normalizer = log_normalizers[row];
    if (scale == 0.0f) {  // padding: the loss does not depend on this row
#pragma omp simd
      for (int64_t j = 0; j < classes; ++j) Store(g, j, 0.0f);
      continue;
    }
    // x - lse <= 0 up to rounding of lse; the clamp keeps ExpNonPositive's domain.
#pragma omp simd
    for (int64_t j = 0; j < classes; ++j) {
      const float shifted = Load(r, j) - normalizer;
      Store(g, j, scale * (ExpNonPositive(shifted > 0.0f ? 0.0f : shifted) - uniform));
    }
    const float label_shifted = Load(r, labels[row]) - normalizer;
    Store(g, labels[row],
          scale * (ExpNonPositive(label_shifted > 0.0f ? 0.0f : label_shifted) - uniform -
                   (1.0f - eps)));
  }
}

template <typename T>
class SmoothedCrossEntropyOp : public OpKernel {
 public:
  explicit SmoothedCrossEntropyOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("label_smoothing", &smoothing_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& logits = context->input(0);
    const Tensor& labels = context->input(1);
    OP_REQUIRES_OK(context, CheckCrossEntropyInputs(logits, labels));
    const int64_t classes = logits.dim_size(logits.dims() - 1);
    const int64_t rows = labels.NumElements();
    TensorShape row_shape = logits.shape();
    row_shape.RemoveLastDims(1);
    Tensor* loss = nullptr;
    Tensor* lse = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, row_shape, &loss));
    OP_REQUIRES_OK(context, context->allocate_output(1, row_shape, &lse));
    const T* x = logits.flat<T>().data();
    const int32_t* y = labels.flat<int32_t>().data();
    float* loss_out = loss->flat<float>().data();
    float* lse_out = lse->flat<float>().data();
    const float eps = smoothing_;
    ParallelRows(context, rows, classes * 12, [&](int64_t begin, int64_t end) {
      CrossEntropyRows(x, y, eps, classes, begin, end, loss_out, lse_out);
    });
  }

 private:
  float smoothing_;
};

template <typename T>
class SmoothedCrossEntropyGradOp : public OpKernel {
 public:
  explicit SmoothedCrossEntropyGradOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("label_smoothing", &smoothing_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& logits = context->input(0);
    const Tensor& labels = context->input(1);
    const Tensor& lse = context->input(2);
    const Tensor& upstream = context->input(3);
    OP_REQUIRES_OK(context, CheckCrossEntropyInputs(logits, labels));
    const int64_t rows = labels.NumElements();
    OP_REQUIRES(context, lse.NumElements() == rows && upstream.NumElements() == rows,
                InvalidArgument("log_normalizer and upstream need one value per label row"));
    const int64_t classes = logits.dim_size(logits.dims() - 1);
    Tensor* gradient = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, logits.shape(), &gradient));
    const T* x = logits.flat<T>().data();
    const int32_t* y = labels.flat<int32_t>().data();
    const float* lse_in = lse.flat<float>().data();
    const float* up = upstream.flat<float>().data();
    T* out = gradient->flat<T>().data();
    const float eps = smoothing_;
    ParallelRows(context, rows, classes * 10, [&](int64_t begin, int64_t end) {
      CrossEntropyGradRows(x, y, lse_in, up, eps, classes, begin, end, out);
    });
  }

 private:
  float smoothing_;
};

KT_REGISTER_CPU_KERNELS("KtSmoothedCrossEntropy", SmoothedCrossEntropyOp);
KT_REGISTER_CPU_KERNELS("KtSmoothedCrossEntropyGrad", SmoothedCrossEntropyGradOp);

}  // namespace
}  // namespace keras_transformer
