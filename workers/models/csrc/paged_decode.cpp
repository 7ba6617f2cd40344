// Decode attention over the paged KV pool in place, on the CPU: each decoding query (one token of a
// request) attends over the keys and values its block table points at, with no gathered copy and no
// padding. Registered as the operator diptych::paged_decode (workers/models/paged_cpu.py builds it).
//
// query [tokens, heads, dim]; key_pool and value_pool [blocks, block_size, kv_heads, dim], contiguous
// float32; rows, positions [n]: each decoding query's row in `query` and its position; table_starts
// [n + 1] into block_ids: the blocks of query i are block_ids[table_starts[i]:table_starts[i + 1]],
// from its request's first block. A query at position p sees the keys at positions first..p, where
// first = max(0, p - window + 1) for window > 0, else 0. The result goes into out's rows.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// Eight floats as one value: the compiler maps it to the machine's vector registers (two on 128-bit ones).
typedef float Lanes __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline Lanes load(const float* p) {
  Lanes v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Lanes v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline float total(Lanes v) {
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += v[l];
  return sum;
}

// Where a kv head's keys (or values) at positions first.. lie in the pool: one pointer per position,
// walked block by block (no division per key).
void locate(const float* pool, const int64_t* blocks, int64_t first, int64_t count, int64_t block_size,
            int64_t token_stride, int64_t offset, std::vector<const float*>& at) {
  at.resize(static_cast<size_t>(count));
  int64_t block = first / block_size, slot = first % block_size;
  const float* base = pool + (blocks[block] * block_size) * token_stride + offset;
  for (int64_t t = 0; t < count; ++t) {
    at[t] = base + slot * token_stride;
    if (++slot == block_size && t + 1 < count) {
      slot = 0;
      base = pool + (blocks[++block] * block_size) * token_stride + offset;
    }
  }
}

// scores[h * count + t] = scale * query_h . key(first + t), four keys at a time (four independent sums).
void score(const float* query, const float* const* keys, int64_t count, int64_t heads, int64_t dim, float scale,
           float* scores) {
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) {
    const float* const* k = keys + t;
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = query + h * dim;
      Lanes sum[4] = {};
      for (int64_t d = 0; d < dim; d += kLanes) {
        const Lanes qd = load(q + d);
        for (int j = 0; j < 4; ++j) sum[j] += qd * load(k[j] + d);
      }
      for (int j = 0; j < 4; ++j) scores[h * count + t + j] = total(sum[j]) * scale;
    }
  }
  for (; t < count; ++t) {
    const float* k = keys[t];
    for (int64_t h = 0; h < heads; ++h) {
      Lanes sum = {};
      for (int64_t d = 0; d < dim; d += kLanes) sum += load(query + h * dim + d) * load(k + d);
      scores[h * count + t] = total(sum) * scale;
    }
  }
}

typedef int32_t IntLanes __attribute__((vector_size(32)));

// e^x lane by lane for x <= 0 (a score less its row's highest), within 2 ulp of expf; x < -87 gives e^-87.
// Range reduction x = n ln2 + f with ln2 in two parts, then a degree-6 polynomial in f and 2^n in the bits.
inline Lanes exp_lanes(Lanes x) {
  x = x < -87.0f ? Lanes{} - 87.0f : x;
  const IntLanes n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, IntLanes);
  const Lanes nf = __builtin_convertvector(n, Lanes);
  const Lanes f = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  Lanes p = 1.9875691500e-4f * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  const Lanes y = p * f * f + f + 1.0f;
  IntLanes bits;
  __builtin_memcpy(&bits, &y, sizeof(bits));
  bits += n << 23;
  Lanes result;
  __builtin_memcpy(&result, &bits, sizeof(result));
  return result;
}

// Each head's scores become its softmax weights. A NaN score (from NaN or infinite queries or keys)
// makes all of its head's weights NaN, so the failure reaches the logits as SDPA's would.
void softmax(float* scores, int64_t count, int64_t heads) {
  for (int64_t h = 0; h < heads; ++h) {
    float* row = scores + h * count;
    float highest = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t t = 0; t < count; ++t) {
      highest = std::max(highest, row[t]);
      nan |= row[t] != row[t];
    }
    if (nan || !std::isfinite(highest)) {
      std::fill(row, row + count, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    Lanes sums = {};
    int64_t t = 0;
    for (; t + kLanes <= count; t += kLanes) {
      const Lanes e = exp_lanes(load(row + t) - highest);
      store(row + t, e);
      sums += e;
    }
    float sum = total(sums);
    for (; t < count; ++t) {
      row[t] = std::exp(row[t] - highest);
      sum += row[t];
    }
    const float inverse = 1.0f / sum;
    for (t = 0; t < count; ++t) row[t] *= inverse;
  }
}

// out_h = sum over t of weight_h(t) * value(first + t), four vectors of the head at a time.
void weigh(const float* weights, const float* const* values, int64_t count, int64_t heads, int64_t dim,
           float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* w = weights + h * count;
    int64_t d = 0;
    for (; d + 4 * kLanes <= dim; d += 4 * kLanes) {
      Lanes sum[4] = {};
      for (int64_t t = 0; t < count; ++t) {
        const float* v = values[t] + d;
        for (int j = 0; j < 4; ++j) sum[j] += w[t] * load(v + j * kLanes);
      }
      for (int j = 0; j < 4; ++j) store(out + h * dim + d + j * kLanes, sum[j]);
    }
    for (; d < dim; d += kLanes) {
      Lanes sum = {};
      for (int64_t t = 0; t < count; ++t) sum += w[t] * load(values[t] + d);
      store(out + h * dim + d, sum);
    }
  }
}

void paged_decode(const at::Tensor& query, const at::Tensor& key_pool, const at::Tensor& value_pool, at::Tensor& out,
                  const at::Tensor& rows, const at::Tensor& positions, const at::Tensor& table_starts,
                  const at::Tensor& block_ids, double scale, int64_t window) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_pool.scalar_type() == at::kFloat, "paged_decode: float32 only");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && key_pool.is_contiguous() && value_pool.is_contiguous(),
              "paged_decode: contiguous query, out and pools only");
  TORCH_CHECK(query.dim() == 3 && key_pool.dim() == 4 && out.sizes() == query.sizes(), "paged_decode: bad shapes");
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t block_size = key_pool.size(1), kv_heads = key_pool.size(2);
  TORCH_CHECK(key_pool.size(3) == dim && heads % kv_heads == 0, "paged_decode: heads and pool disagree");
  TORCH_CHECK(dim % kLanes == 0, "paged_decode: head_dim must be a multiple of ", kLanes);
  const int64_t group_heads = heads / kv_heads;
  const int64_t count = rows.numel();
  const float* q = query.data_ptr<float>();
  const float* k = key_pool.data_ptr<float>();
  const float* v = value_pool.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* position_of = positions.data_ptr<int64_t>();
  const int64_t* starts = table_starts.data_ptr<int64_t>();
  const int64_t* blocks = block_ids.data_ptr<int64_t>();
  const float scale_f = static_cast<float>(scale);
  const int64_t tokens = query.size(0), pool_blocks = key_pool.size(0);
  TORCH_CHECK(positions.numel() == count && table_starts.numel() == count + 1, "paged_decode: metadata lengths differ");
  for (int64_t i = 0; i < count; ++i) {  // every read below stays inside the pool and the query
    TORCH_CHECK(row_of[i] >= 0 && row_of[i] < tokens && position_of[i] >= 0, "paged_decode: row or position out of range");
    TORCH_CHECK(starts[i] >= 0 && starts[i + 1] <= block_ids.numel() && position_of[i] / block_size < starts[i + 1] - starts[i],
                "paged_decode: a query's blocks do not reach its position");
  }
  for (int64_t j = 0; j < block_ids.numel(); ++j)
    TORCH_CHECK(blocks[j] >= 0 && blocks[j] < pool_blocks, "paged_decode: block id ", blocks[j], " is outside the pool");
  // One query's kv heads together: a block's keys (and values) are read front to back, each once.
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> key_at, value_at;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t position = position_of[i];
      const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      const int64_t keys = position - first + 1;
      const int64_t* table = blocks + starts[i];
      scores.resize(static_cast<size_t>(keys * group_heads));
      for (int64_t group = 0; group < kv_heads; ++group) {
        const int64_t offset = (row_of[i] * heads + group * group_heads) * dim;
        locate(k, table, first, keys, block_size, kv_heads * dim, group * dim, key_at);
        locate(v, table, first, keys, block_size, kv_heads * dim, group * dim, value_at);
        score(q + offset, key_at.data(), keys, group_heads, dim, scale_f, scores.data());
        softmax(scores.data(), keys, group_heads);
        weigh(scores.data(), value_at.data(), keys, group_heads, dim, o + offset);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(diptych, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key_pool, Tensor value_pool, Tensor(a!) out, Tensor rows, "
      "Tensor positions, Tensor table_starts, Tensor block_ids, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(diptych, CPU, m) { m.impl("paged_decode", paged_decode); }
