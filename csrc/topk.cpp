// The k largest entries of each row of a float32 matrix, for the searches of decoding: each
// decoding step takes the best few tokens of every row of [rows, vocabulary] log-probabilities
// (k = 2 x beam, or 1 for greedy). torch.topk on the CPU spends ~3 us per row on its own
// bookkeeping (a [320, 400] top-10 costs 2/3 of a [320, 4000] one). Here ATen's vectorised
// amax gives the maximum of every stripe of 16 entries, and a row's scan visits only the
// stripes whose maximum reaches the k-th best so far, inserting the few entries above it.
//
// _topk_rows(x [R, V] float32, k) -> (values [R, k] float32, indices [R, k] int64): each row's k
// largest entries, largest first; equal entries in index order (the first one first). NaN
// entries are never chosen unless a row has fewer than k other entries (then they come last).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <limits>
#include <tuple>

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
// entries s, s + stripes, ..., s + (kBlock - 1) * stripes (NaN where one of them is) -> vals,
// idx [k]. The k largest stripe maxima are k distinct entries, so the k-th of them is at most
// the row's k-th largest entry: every entry that belongs in the list lies in a stripe whose
// maximum reaches it (or past the stripes), and only those stripes are read.
void topk_row(const float* row, const float* stripe_max, int64_t n, int64_t stripes, int64_t k,
              float* vals, int64_t* idx) {
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
  clear();
  float bound = lowest;  // the k-th largest stripe maximum (-inf with fewer than k stripes)
  if (stripes >= k) {
    for (int64_t s = 0; s < stripes; ++s) consider(stripe_max[s], s);
    bound = idx[k - 1] == kNone ? lowest : vals[k - 1];
    clear();
  }
  for (int64_t s = 0; s < stripes; ++s) {
    const float m = stripe_max[s];
    if (!(m >= bound) && !std::isnan(m)) continue;
    for (int64_t t = 0; t < kBlock; ++t) consider(row[s + t * stripes], s + t * stripes);
  }
  for (int64_t i = stripes * kBlock; i < n; ++i) consider(row[i], i);
  // Fewer than k entries that are not NaN: the NaN ones fill the rest, in index order.
  int64_t pos = 0;
  while (pos < k && idx[pos] != kNone) ++pos;
  for (int64_t i = 0; i < n && pos < k; ++i) {
    if (std::isnan(row[i])) {
      vals[pos] = row[i];
      idx[pos++] = i;
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
  // The stripes' maxima by ATen's vectorised reduction (an elementwise maximum of kBlock
  // contiguous slices of each row): a row's scan then looks at the few stripes that can hold
  // one of its k best.
  const int64_t stripes = n / kBlock;
  const Tensor stripe_max =
      stripes > 0
          ? x.narrow(1, 0, stripes * kBlock).view({rows, kBlock, stripes}).amax(1).contiguous()
          : at::empty({rows, 0}, x.options());
  const float* m_p = stripe_max.data_ptr<float>();
  const float* x_p = x.data_ptr<float>();
  float* v_p = values.data_ptr<float>();
  int64_t* i_p = indices.data_ptr<int64_t>();
  // Rows in parallel: ~n compares each, so grains of rows worth ~32k entries.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      topk_row(x_p + r * n, m_p + r * stripes, n, stripes, k, v_p + r * k, i_p + r * k);
    }
  });
  return {values, indices};
}

}  // namespace
}  // namespace seq2seq_fast

TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def("_topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) { m.impl("_topk_rows", &seq2seq_fast::topk_rows); }
