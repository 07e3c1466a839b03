// Shared by the synchronous and the io_uring paths of the backend; not part of its interface.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/backend.h"

namespace shareblk::backend {

inline constexpr size_t kZeroBufferSize = 1 << 20;

// The fallocate(2) mode that carries out a trim or write-zeroes on this volume.
int fallocate_mode(const Volume& volume, Op op, uint32_t flags);

// kZeroBufferSize zero bytes, aligned for O_DIRECT; for write-zeroes where fallocate cannot.
const char* zero_buffer();

}  // namespace shareblk::backend
