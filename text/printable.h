// text: a caller's string as it may be shown, in the daemon's log lines (the control plane's
// and the NBD target's) and in the CLI's tables. One rule for all, header-only so that every
// part can use it without linking another.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "text/hex.h"

namespace shareblk {

// `text` with control characters and bytes past ASCII escaped (\n, \xNN) and the backslash
// doubled, at most `max_bytes` of it (then "..."), so that a name cannot forge a line, a table
// row or a terminal sequence. What comes out is printable ASCII, one byte a column.
inline std::string printable(std::string_view text, size_t max_bytes = 256) {
  std::string out;
  for (unsigned char c : text.substr(0, max_bytes)) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      append_hex(out, c);
    }
  }
  if (text.size() > max_bytes) out += "...";
  return out;
}

}  // namespace shareblk
