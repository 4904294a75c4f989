// The k largest entries of each row of a float32 matrix, for the searches of decoding: each
// decoding step takes the best few tokens of every row of [rows, vocabulary] log-probabilities
// (k = 2 x beam, or 1 for greedy). torch.topk on the CPU spends ~3 us per row on its own
// bookkeeping (a [320, 400] top-10 costs 2/3 of a [320, 4000] one). Here a vectorised pass gives
// the maximum of every stripe of 16 entries, and a row's scan visits only the stripes whose
// maximum reaches the k-th largest stripe maximum, inserting the few entries above it.
//
// _topk_rows(x [R, V] float32, k) -> (values [R, k] float32, indices [R, k] int64): each row's k
// largest entries, largest first; equal entries in index order (the first one first). NaN
// entries are never chosen unless a row has fewer than k other entries (then they come last).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "runtime.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace seq2seq_fast {
namespace {

using at::Tensor;

constexpr int64_t kBlock = 16;

// Whether (value, index) ranks before (other, other_index): larger first, equal ones in index
// order. False for a NaN value.
inline bool before(float value, int64_t index, float other, int64_t other_index) {
  return value > other || (value == other && index < other_index);
}

// Insert (value, index) into the ranked arrays of length k, dropping the last.
inline void insert(float* vals, int64_t* idx, int64_t k, float value, int64_t index) {
  int64_t pos = k - 1;
  while (pos > 0 && before(value, index, vals[pos - 1], idx[pos - 1])) {
    vals[pos] = vals[pos - 1];
    idx[pos] = idx[pos - 1];
    --pos;
  }
  vals[pos] = value;
  idx[pos] = index;
}

// One row: row [n], stripe_max [stripes] where stripes = n / kBlock and stripe s holds the
// entries s, s + stripes, ..., s + (kBlock - 1) * stripes (its maximum over the entries that are
// not NaN; -inf if none) -> vals, idx [k]. The k largest stripe maxima are k distinct entries, so the k-th of them is at most
// the row's k-th largest entry: every entry that belongs in the list lies in a stripe whose
// maximum reaches it (or past the stripes), and only those stripes are read.
void topk_row(const float* row, const float* stripe_max, int64_t n, int64_t stripes, int64_t k,
              float* vals, int64_t* idx, int64_t exclude = -1) {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();  // ranks after any entry
  const float lowest = -std::numeric_limits<float>::infinity();
  auto clear = [&] {
    for (int64_t i = 0; i < k; ++i) {
      vals[i] = lowest;
      idx[i] = kNone;
    }
  };
  auto consider = [&](float v, int64_t i) {
    if (before(v, i, vals[k - 1], idx[k - 1])) insert(vals, idx, k, v, i);
  };
  auto consider_entry = [&](int64_t i) {
    if (i != exclude) consider(row[i], i);
  };
  clear();
  float bound = lowest;  // the k-th largest stripe maximum (-inf with fewer than k stripes)
  if (stripes >= k) {
    for (int64_t s = 0; s < stripes; ++s) consider(stripe_max[s], s);
    bound = idx[k - 1] == kNone ? lowest : vals[k - 1];
    clear();
  }
  for (int64_t s = 0; s < stripes; ++s) {
    const float m = stripe_max[s];
    if (!(m >= bound)) continue;
    for (int64_t t = 0; t < kBlock; ++t) {
      const int64_t i = s + t * stripes;
      if (row[i] >= bound) consider_entry(i);  // below the bound: never in the list
    }
  }
  for (int64_t i = stripes * kBlock; i < n; ++i) consider_entry(i);
  // Fewer than k entries that are not NaN: the NaN ones fill the rest, in index order.
  int64_t pos = 0;
  while (pos < k && idx[pos] != kNone) ++pos;
  for (int64_t i = 0; i < n && pos < k; ++i) {
    if (std::isnan(row[i]) && i != exclude) {
      vals[pos] = row[i];
      idx[pos++] = i;
    }
  }
}

// The stripes' maxima of a row: an elementwise maximum of kBlock contiguous slices (a loop the
// compiler vectorises), NaN entries and the entry ``exclude`` left out (-inf where none is left).
void stripe_maxima(const float* row, int64_t stripes, int64_t exclude, float* m) {
  for (int64_t s = 0; s < stripes; ++s) m[s] = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < kBlock; ++t) {
    const float* slice = row + t * stripes;
    for (int64_t s = 0; s < stripes; ++s) m[s] = m[s] < slice[s] ? slice[s] : m[s];
  }
  if (exclude >= 0 && exclude < stripes * kBlock) {
    const int64_t s = exclude % stripes;
    m[s] = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < kBlock; ++t) {
      const int64_t i = s + t * stripes;
      if (i != exclude && m[s] < row[i]) m[s] = row[i];
    }
  }
}

std::tuple<Tensor, Tensor> topk_rows(const Tensor& x_in, int64_t k) {
  TORCH_CHECK(x_in.dim() == 2, "_topk_rows: x must be [rows, n], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "_topk_rows: x must be float32, got ",
              x_in.scalar_type());
  const int64_t rows = x_in.size(0), n = x_in.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "_topk_rows: k must be in [1, ", n, "], got ", k);
  const Tensor x = x_in.contiguous();
  Tensor values = at::empty({rows, k}, x.options());
  Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  const int64_t stripes = n / kBlock;
  const float* x_p = x.data_ptr<float>();
  float* v_p = values.data_ptr<float>();
  int64_t* i_p = indices.data_ptr<int64_t>();
  // Rows in parallel: ~n compares each, so grains of rows worth ~32k entries.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> stripe_max(static_cast<size_t>(stripes));
    float* m = stripe_max.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x_p + r * n;
      stripe_maxima(row, stripes, -1, m);  // the row stays in cache for the scan
      topk_row(row, m, n, stripes, k, v_p + r * k, i_p + r * k);
    }
  });
  return {values, indices};
}

// _log_softmax_topk(logits [R, V] float32, k, exclude) -> (values [R, k], indices [R, k]): the k
// largest entries of each row's log-softmax, as log_softmax(logits).topk(k) with the entry
// ``exclude`` (e.g. <pad>; -1 for none) counted in the normaliser but never chosen. One read of
// the row for its stripes' maxima (and its maximum), one for the normaliser (the kernel table's
// vectorised exp), then the scan: the [R, V] log-probabilities are never written.
std::tuple<Tensor, Tensor> log_softmax_topk(const Tensor& x_in, int64_t k, int64_t exclude) {
  TORCH_CHECK(x_in.dim() == 2, "_log_softmax_topk: logits must be [rows, n], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "_log_softmax_topk: logits must be float32, got ",
              x_in.scalar_type());
  const int64_t rows = x_in.size(0), n = x_in.size(1);
  const int64_t eligible = n - (exclude >= 0 && exclude < n ? 1 : 0);
  TORCH_CHECK(k >= 1 && k <= eligible, "_log_softmax_topk: k must be in [1, ", eligible, "], got ",
              k);
  TORCH_CHECK(exclude >= -1 && exclude < n, "_log_softmax_topk: exclude must be -1 or in [0, ",
              n, "), got ", exclude);
  const Tensor x = x_in.contiguous();
  Tensor values = at::empty({rows, k}, x.options());
  Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* x_p = x.data_ptr<float>();
  float* v_p = values.data_ptr<float>();
  int64_t* i_p = indices.data_ptr<int64_t>();
  const int64_t stripes = n / kBlock;
  const auto& kt = runtime_kernels<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> stripe_max(static_cast<size_t>(stripes)), buffer(static_cast<size_t>(n));
    float *m = stripe_max.data(), *e = buffer.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x_p + r * n;
      float* vals = v_p + r * k;
      int64_t* idx = i_p + r * k;
      stripe_maxima(row, stripes, -1, m);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < stripes; ++s) top = std::max(top, m[s]);
      for (int64_t i = stripes * kBlock; i < n; ++i) top = std::max(top, row[i]);
      // log sum exp over every entry (the excluded one too), shifted by the maximum
      double total = 0.0;
      if (std::isfinite(top)) {
        for (int64_t i = 0; i < n; ++i) e[i] = row[i] - top;
        kt.exp_inplace(e, n, 1.0f);
        float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
          for (int j = 0; j < 8; ++j) partial[j] += e[i + j];
        }
        for (; i < n; ++i) partial[0] += e[i];
        for (int j = 0; j < 8; ++j) total += partial[j];
      }
      const float lse = std::isfinite(top) ? top + float(std::log(total)) : top;
      if (exclude >= 0) stripe_maxima(row, stripes, exclude, m);
      topk_row(row, m, n, stripes, k, vals, idx, exclude);
      for (int64_t j = 0; j < k; ++j) vals[j] -= lse;
    }
  });
  return {values, indices};
}

}  // namespace
}  // namespace seq2seq_fast

TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def("_topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("_log_softmax_topk(Tensor logits, int k, int exclude) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) {
  m.impl("_topk_rows", &seq2seq_fast::topk_rows);
  m.impl("_log_softmax_topk", &seq2seq_fast::log_softmax_topk);
}
