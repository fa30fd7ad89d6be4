// A GGUF header's string array (a vocabulary's tokens or merges, ~10^5 strings) walked in C++.
//
// Each string is a u64 little-endian length and that many UTF-8 bytes, one after another, so where the
// next one starts is known only once this one's length is read: in Python, a loop of several bytecodes
// a string.
// run(file, pos, count) walks the `count` strings from byte `pos` and returns their bytes with each
// length field replaced by eight NUL bytes; Python decodes that run once and splits it at the NULs
// (gguf_strings.py). A run that leaves the file returns an empty tensor: the Python reader then reads
// string by string and names the fault. Built at first use by tformer/interop/gguf_strings.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <cstdint>
#include <cstring>

namespace {

at::Tensor run(const at::Tensor& file, int64_t pos, int64_t count) {
  TORCH_CHECK(file.dim() == 1 && file.scalar_type() == at::kByte && file.is_contiguous(),
              "run: file must be contiguous uint8 (bytes,)");
  const uint8_t* data = file.data_ptr<uint8_t>();
  const uint64_t size = uint64_t(file.numel());
  TORCH_CHECK(pos >= 0 && count >= 0, "run: pos and count must not be negative");
  uint64_t at = uint64_t(pos);
  for (int64_t i = 0; i < count; ++i) {          // where the run ends, every length inside the file
    uint64_t n;
    if (at > size || size - at < 8) return at::empty({0}, file.options());
    std::memcpy(&n, data + at, 8);
    if (n > size - at - 8) return at::empty({0}, file.options());
    at += 8 + n;
  }
  at::Tensor out = at::empty({int64_t(at - uint64_t(pos))}, file.options());
  uint8_t* o = out.data_ptr<uint8_t>();
  std::memcpy(o, data + pos, at - uint64_t(pos));
  for (uint64_t p = 0, end = at - uint64_t(pos); p < end;) {   // each length field becomes eight NULs
    uint64_t n;
    std::memcpy(&n, o + p, 8);
    std::memset(o + p, 0, 8);
    p += 8 + n;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tformer_strings, m) { m.def("run(Tensor file, int pos, int count) -> Tensor"); }

TORCH_LIBRARY_IMPL(tformer_strings, CPU, m) { m.impl("run", &run); }
