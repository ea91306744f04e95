// 3.1 + 5.4 Post-norm residual block, LayerNorm(residual + Dropout(x)), as one C++ op forward
// and one backward (issue 6). Built by keras_transformer/kernels/__init__.py on first use.

#include "common.h"

namespace keras_transformer {
namespace {

// ---- 3.1 + 5.4 post-norm residual block: LayerNorm(residual + Dropout(x)) ---------------
//
// Dropout keeps element i when Hash(seed, i) >= threshold (a 32-bit threshold, so the rate is
// exact to 2^-32) and scales survivors by 1 / (1 - rate). The mask is a pure function of the
// seed and the element's index: the backward pass recomputes it instead of storing it.
// The forward pass keeps per-row mean and 1/std; the backward pass recomputes the sum.

inline uint32_t Mix(uint32_t v) {  // "lowbias32" integer hash (C. Wellons)
  v ^= v >> 16;
  v *= 0x7feb352du;
  v ^= v >> 15;
  v *= 0x846ca68bu;
  v ^= v >> 16;
  return v;
}

struct DropoutMask {
  uint32_t key0 = 0, key1 = 0, threshold = 0;
  float scale = 1.0f;
  bool active = false;
  // Writes the survivor scale (1 / (1 - rate)) or 0 for elements offset .. offset + n - 1.
  // Without dropout `keep` holds ones, written once (`first`): the row loops then multiply
  // by keep[j] unconditionally, which vectorizes where a per-element branch did not.
  inline void Fill(float* __restrict keep, int64_t offset, int64_t n, bool first) const {
    if (!active) {
      if (first) std::fill(keep, keep + n, 1.0f);
      return;
    }
    const uint32_t k0 = key0, k1 = key1, t = threshold;  // locals: no aliasing with keep
    const float s = scale;
    const uint32_t start = static_cast<uint32_t>(offset);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      keep[j] = Mix(Mix((start + static_cast<uint32_t>(j)) ^ k0) + k1) >= t ? s : 0.0f;
    }
  }
};

Status ReadDropout(const Tensor& seed, float rate, DropoutMask* mask) {
  if (seed.NumElements() != 2) {
    return InvalidArgument("seed must have 2 elements, got ", seed.shape().DebugString());
  }
  if (!(rate >= 0.0f && rate < 1.0f)) {  // also rejects NaN
    return InvalidArgument("dropout rate must be in [0, 1), got ", rate);
  }
  const auto s = seed.flat<int64_t>();
  mask->key0 = Mix(static_cast<uint32_t>(s(0)) ^ Mix(static_cast<uint32_t>(s(0) >> 32)));
  mask->key1 = Mix(static_cast<uint32_t>(s(1)) ^ Mix(static_cast<uint32_t>(s(1) >> 32) + 1u));
  const double threshold = std::round(static_cast<double>(rate) * 4294967296.0);
  mask->threshold = static_cast<uint32_t>(std::min(threshold, 4294967295.0));
  mask->scale = rate > 0.0f ? static_cast<float>(1.0 / (1.0 - rate)) : 1.0f;
  mask->active = rate > 0.0f;
  return Status();
}

Status ResidualNormShape(InferenceContext* c) {
  ShapeHandle rows;
  TF_RETURN_IF_ERROR(c->Subshape(c->input(0), 0, -1, &rows));
  c->set_output(0, c->input(0));
  c->set_output(1, rows);
  c->set_output(2, rows);
  return Status();
}

REGISTER_OP("KtResidualNorm")
    .Input("x: T")
    .Input("residual: T")
    .Input("gamma: float")
    .Input("beta: float")
    .Input("seed: int64")
    .Output("y: T")
    .Output("mean: float")
    .Output("inverse_std: float")
    .Attr("T: {float, bfloat16}")
    .Attr("epsilon: float")
    .Attr("rate: float")
    .SetShapeFn(ResidualNormShape);

REGISTER_OP("KtResidualNormGrad")
    .Input("upstream: T")
    .Input("x: T")
    .Input("residual: T")
    .Input("gamma: float")
    .Input("seed: int64")
    .Input("mean: float")
    .Input("inverse_std: float")
    .Output("x_gradient: T")
    .Output("residual_gradient: T")
    .Output("gamma_gradient: float")
    .Output("beta_gradient: float")
    .Attr("T: {float, bfloat16}")
    .Attr("rate: float")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(1));
      c->set_output(2, c->input(3));
      c->set_output(3, c->input(3));
      return Status();
    });

Status CheckResidualInputs(const Tensor& x, const Tensor& residual, const Tensor& gamma) {
  if (x.dims() < 1 || x.shape() != residual.shape()) {
    return InvalidArgument("x ", x.shape().DebugString(), " and residual ",
                           residual.shape().DebugString(), " must have the same shape");
  }
  const int64_t features = x.dim_size(x.dims() - 1);
  if (features == 0) {
    return InvalidArgument("x has no features to normalize: shape ", x.shape().DebugString());
  }
  if (gamma.dims() != 1 || gamma.dim_size(0) != features) {
    return InvalidArgument("gamma/beta must be (", features, ",), got ",
                           gamma.shape().DebugString());
  }
  if (x.NumElements() > (int64_t{1} << 32)) {
    return InvalidArgument("more than 2^32 elements: the dropout index would wrap");
  }
  return Status();
}

// Rows [begin, end) of the forward pass. Plain restrict pointers (not lambda captures) so
// that g++ knows the bfloat16 stores do not alias the inputs, and vectorizes.
template <typename T>
void ResidualNormRows(const T* __restrict x, const T* __restrict residual,
                      const float* __restrict gamma, const float* __restrict beta,
                      const DropoutMask& mask, float epsilon, int64_t features, int64_t begin,
                      int64_t end, T* __restrict y, float* __restrict means,
                      float* __restrict inverse_stds) {
  std::vector<float> buffer(2 * features);
  float* __restrict s = buffer.data();
  float* __restrict keep = s + features;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t offset = row * features;
    mask.Fill(keep, offset, features, row == begin);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < features; ++j) {
      const float v = Load(residual, offset + j) + Load(x, offset + j) * keep[j];
      s[j] = v;
      total += v;
    }
    const float mean = total / static_cast<float>(features);
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t j = 0; j < features; ++j) squares += (s[j] - mean) * (s[j] - mean);
    const float inverse_std = 1.0f / std::sqrt(squares / features + epsilon);
    means[row] = mean;
    inverse_stds[row] = inverse_std;
#pragma omp simd
    for (int64_t j = 0; j < features; ++j) {
      Store(y, offset + j, (s[j] - mean) * inverse_std * gamma[j] + beta[j]);
    }
  }
}

// Rows [begin, end) of the backward pass; adds this block's gamma/beta gradients to
// dgamma/dbeta. With x_hat the normalized sum and g = dy * gamma:
//   d sum = (g - mean(g) - x_hat * mean(g * x_hat)) / std;  dx = d sum * keep.
template <typename T>
void ResidualNormGradRows(const T* __restrict dy, const T* __restrict x,
                          const T* __restrict residual, const float* __restrict gamma,
                          const float* __restrict means, const float* __restrict inverse_stds,
                          const DropoutMask& mask, int64_t features, int64_t begin, int64_t end,
                          T* __restrict dx, T* __restrict dres, float* __restrict dgamma,
                          float* __restrict dbeta) {
  std::vector<float> buffer(3 * features);
  float* __restrict xhat = buffer.data();
  float* __restrict scaled = xhat + features;
  float* __restrict keep = scaled + features;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t offset = row * features;
    const float mean = means[row], inverse_std = inverse_stds[row];
    mask.Fill(keep, offset, features, row == begin);
    float scaled_sum = 0.0f, dot = 0.0f;
#pragma omp simd reduction(+ : scaled_sum, dot)
    for (int64_t j = 0; j < features; ++j) {
      const float normalized =
          (Load(residual, offset + j) + Load(x, offset + j) * keep[j] - mean) * inverse_std;
      const float g = Load(dy, offset + j);
      const float gs = g * gamma[j];
      xhat[j] = normalized;
      scaled[j] = gs;
      dgamma[j] += g * normalized;
      dbeta[j] += g;
      scaled_sum += gs;
      dot += gs * normalized;
    }
    const float mean_scaled = scaled_sum / features, mean_dot = dot / features;
#pragma omp simd
    for (int64_t j = 0; j < features; ++j) {
      const float ds = inverse_std * (scaled[j] - mean_scaled - xhat[j] * mean_dot);
      Store(dres, offset + j, ds);
      Store(dx, offset + j, ds * keep[j]);
    }
  }
}

template <typename T>
class ResidualNormOp : public OpKernel {
 public:
  explicit ResidualNormOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("epsilon", &epsilon_));
    OP_REQUIRES_OK(context, context->GetAttr("rate", &rate_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& residual = context->input(1);
    const Tensor& gamma = context->input(2);
    const Tensor& beta = context->input(3);
    OP_REQUIRES_OK(context, CheckResidualInputs(x, residual, gamma));
    OP_REQUIRES(context, beta.shape() == gamma.shape(),
                InvalidArgument("beta must have gamma's shape"));
    DropoutMask mask;
    OP_REQUIRES_OK(context, ReadDropout(context->input(4), rate_, &mask));
    const int64_t features = x.dim_size(x.dims() - 1);
    const int64_t rows = x.NumElements() / features;  // features > 0: checked
    TensorShape row_shape = x.shape();
    row_shape.RemoveLastDims(1);
    Tensor *y = nullptr, *means = nullptr, *inverse_stds = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, x.shape(), &y));
    OP_REQUIRES_OK(context, context->allocate_output(1, row_shape, &means));
    OP_REQUIRES_OK(context, context->allocate_output(2, row_shape, &inverse_stds));
    const float epsilon = epsilon_;
    ParallelRows(context, rows, features * 20, [&](int64_t begin, int64_t end) {
      ResidualNormRows(x.flat<T>().data(), residual.flat<T>().data(),
                       gamma.flat<float>().data(), beta.flat<float>().data(), mask, epsilon,
                       features, begin, end, y->flat<T>().data(), means->flat<float>().data(),
                       inverse_stds->flat<float>().data());
    });
  }

 private:
  float epsilon_, rate_;
};

template <typename T>
class ResidualNormGradOp : public OpKernel {
 public:
  explicit ResidualNormGradOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("rate", &rate_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& upstream = context->input(0);
    const Tensor& x = context->input(1);
    const Tensor& residual = context->input(2);
    const Tensor& gamma = context->input(3);
    const Tensor& means = context->input(5);
    const Tensor& inverse_stds = context->input(6);
    OP_REQUIRES_OK(context, CheckResidualInputs(x, residual, gamma));
    DropoutMask mask;
    OP_REQUIRES_OK(context, ReadDropout(context->input(4), rate_, &mask));
    const int64_t features = x.dim_size(x.dims() - 1);
    const int64_t rows = x.NumElements() / features;  // features > 0: checked
    OP_REQUIRES(context, upstream.shape() == x.shape() && means.NumElements() == rows &&
                             inverse_stds.NumElements() == rows,
                InvalidArgument("upstream, mean and inverse_std do not match x"));
    Tensor *dx = nullptr, *dres = nullptr, *dgamma_out = nullptr, *dbeta_out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, x.shape(), &dx));
    OP_REQUIRES_OK(context, context->allocate_output(1, x.shape(), &dres));
    OP_REQUIRES_OK(context, context->allocate_output(2, gamma.shape(), &dgamma_out));
    OP_REQUIRES_OK(context, context->allocate_output(3, gamma.shape(), &dbeta_out));

    // gamma/beta gradients sum over rows: each block of kRowsPerBlock rows accumulates its own
    // partial sums, added up in order afterwards (deterministic whatever the threading).
    constexpr int64_t kRowsPerBlock = 64;
    const int64_t blocks = std::max<int64_t>(1, (rows + kRowsPerBlock - 1) / kRowsPerBlock);
    std::vector<float> partial(2 * blocks * features, 0.0f);
    ParallelRows(context, blocks, kRowsPerBlock * features * 30,
                 [&](int64_t block_begin, int64_t block_end) {
      for (int64_t block = block_begin; block < block_end; ++block) {
        float* dgamma = partial.data() + 2 * block * features;
        ResidualNormGradRows(upstream.flat<T>().data(), x.flat<T>().data(),
                             residual.flat<T>().data(), gamma.flat<float>().data(),
                             means.flat<float>().data(), inverse_stds.flat<float>().data(),
                             mask, features, block * kRowsPerBlock,
                             std::min(rows, (block + 1) * kRowsPerBlock),
                             dx->flat<T>().data(), dres->flat<T>().data(), dgamma,
                             dgamma + features);
      }
    });
    float* dgamma = dgamma_out->flat<float>().data();
    float* dbeta = dbeta_out->flat<float>().data();
    std::fill(dgamma, dgamma + features, 0.0f);
    std::fill(dbeta, dbeta + features, 0.0f);
    for (int64_t block = 0; block < blocks; ++block) {
      const float* source = partial.data() + 2 * block * features;
      for (int64_t j = 0; j < features; ++j) {
        dgamma[j] += source[j];
        dbeta[j] += source[features + j];
      }
    }
  }

 private:
  float rate_;
};

KT_REGISTER_CPU_KERNELS("KtResidualNorm", ResidualNormOp);
KT_REGISTER_CPU_KERNELS("KtResidualNormGrad", ResidualNormGradOp);

}  // namespace
}  // namespace keras_transformer
