// Small state files beside the database (the PSK secret, the gateway's id) that a crash must
// leave whole: the old content or the new, never a part.
#pragma once

#include <sys/types.h>

#include <string>

namespace shareblk::control {

// Replaces `path` with `data`: written to PATH.new with `mode`, synced, renamed over `path`,
// and the directory synced, so that the new name survives a crash too. Returns 0 or an errno;
// on failure PATH.new is gone and `path` unchanged.
int replace_small_file(const std::string& path, const std::string& data, mode_t mode);

}  // namespace shareblk::control
