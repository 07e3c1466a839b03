// The metrics text (Prometheus exposition format 0.0.4), named after node_exporter's disk
// statistics (node_disk_reads_completed_total, node_disk_read_bytes_total, ...) with the
// prefix shareblk_attachment_. docs/metrics.md is its reference; keep the two in step.
#include <charconv>
#include <string_view>

#include "metrics/metrics.h"

namespace shareblk::metrics {

namespace {

using target::IoStats;

// The node_exporter-style names of one kind of request: completed, bytes, time.
struct KindNames {
  const char* completed;
  const char* bytes;  // nullptr: the kind moves no bytes (flush)
  const char* time;
};

constexpr KindNames kKindNames[IoStats::kKinds] = {
    {"reads_completed_total", "read_bytes_total", "read_time_seconds_total"},
    {"writes_completed_total", "written_bytes_total", "write_time_seconds_total"},
    {"discards_completed_total", "discarded_bytes_total", "discard_time_seconds_total"},
    {"write_zeroes_completed_total", "write_zeroes_bytes_total", "write_zeroes_time_seconds_total"},
    {"flush_requests_total", nullptr, "flush_requests_time_seconds_total"},
    {"block_status_requests_total", "block_status_bytes_total", "block_status_time_seconds_total"},
    {"cache_requests_total", "cache_bytes_total", "cache_time_seconds_total"},
};

void append_number(std::string& out, double v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, ec == std::errc() ? end : buf);
}

void append_number(std::string& out, uint64_t v) {
  out += std::to_string(v);
}

// A label value: backslash, double quote and newline escaped, as the format asks.
void append_label_value(std::string& out, std::string_view value) {
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
}

class Writer {
 public:
  explicit Writer(const std::vector<control::AttachmentStats>& attachments)
      : attachments_(attachments) {}

  void family(std::string_view name, const char* type, const char* help) {
    out_ += "# HELP shareblk_attachment_";
    out_ += name;
    out_ += ' ';
    out_ += help;
    out_ += "\n# TYPE shareblk_attachment_";
    out_ += name;
    out_ += ' ';
    out_ += type;
    out_ += '\n';
  }

  // One sample of `a`, with `extra` labels (already formatted: `op="read",le="1e-06"`).
  template <typename Number>
  void sample(std::string_view name, const control::AttachmentStats& a, std::string_view extra,
              Number value) {
    out_ += "shareblk_attachment_";
    out_ += name;
    out_ += "{attachment=\"";
    append_label_value(out_, a.attachment_id);
    out_ += "\",volume=\"";
    append_label_value(out_, a.volume_id);
    out_ += "\",mode=\"";
    append_label_value(out_, a.mode);
    out_ += '"';
    if (!extra.empty()) {
      out_ += ',';
      out_ += extra;
    }
    out_ += "} ";
    append_number(out_, value);
    out_ += '\n';
  }

  // A family with one sample per attachment.
  template <typename Get>
  void per_attachment(std::string_view name, const char* type, const char* help, Get get) {
    family(name, type, help);
    for (const auto& a : attachments_) sample(name, a, "", get(a.figures));
  }

  std::string& text() { return out_; }

 private:
  const std::vector<control::AttachmentStats>& attachments_;
  std::string out_;
};

std::string op_label(size_t kind) {
  return std::string("op=\"") + IoStats::kind_name(kind) + "\"";
}

}  // namespace

std::string render(const std::vector<control::AttachmentStats>& attachments,
                   std::chrono::system_clock::time_point started) {
  Writer w(attachments);
  std::string& out = w.text();
  out +=
      "# HELP shareblk_start_time_seconds When shareblkd started, in seconds since the epoch.\n"
      "# TYPE shareblk_start_time_seconds gauge\nshareblk_start_time_seconds ";
  append_number(out, std::chrono::duration<double>(started.time_since_epoch()).count());
  out += '\n';

  for (size_t k = 0; k < IoStats::kKinds; ++k) {
    const KindNames& n = kKindNames[k];
    const std::string what = IoStats::kind_name(k);
    w.per_attachment(n.completed, "counter",
                     ("NBD " + what + " requests answered, with or without an error.").c_str(),
                     [k](const target::GroupStats& g) { return g.io.ops[k].requests; });
    if (n.bytes != nullptr) {
      w.per_attachment(
          n.bytes, "counter",
          ("Bytes of the NBD " + what + " requests answered without an error.").c_str(),
          [k](const target::GroupStats& g) { return g.io.ops[k].bytes; });
    }
    w.per_attachment(
        n.time, "counter",
        ("Seconds NBD " + what + " requests took, from header to reply, all together.").c_str(),
        [k](const target::GroupStats& g) {
          return static_cast<double>(g.io.ops[k].time_ns) / 1e9;
        });
  }

  w.family("request_errors_total", "counter", "NBD requests answered with an error, by op.");
  for (const auto& a : attachments) {
    for (size_t k = 0; k < IoStats::kKinds; ++k) {
      w.sample("request_errors_total", a, op_label(k), a.figures.io.ops[k].errors);
    }
  }
  w.family("errors_total", "counter", "NBD requests answered with an error, by errno.");
  for (const auto& a : attachments) {
    for (const auto& [err, count] : a.figures.io.errors) {
      std::string label = "errno=\"";
      append_label_value(label, IoStats::errno_name(err));
      w.sample("errors_total", a, label + '"', count);
    }
  }
  w.per_attachment("refused_writes_total", "counter",
                   "Writes, trims and write-zeroes refused with EPERM (read-only, or no write "
                   "access).",
                   [](const target::GroupStats& g) { return g.io.refused_writes; });

  w.family("request_duration_seconds", "histogram",
           "Time NBD requests took, from header to reply, by op.");
  for (const auto& a : attachments) {
    for (size_t k = 0; k < IoStats::kKinds; ++k) {
      const IoStats::Op& op = a.figures.io.ops[k];
      const std::string label = op_label(k);
      uint64_t cumulative = 0;
      for (size_t b = 0; b < IoStats::kBuckets; ++b) {
        cumulative += op.latency[b];
        std::string le = label + ",le=\"";
        if (b + 1 < IoStats::kBuckets) {
          append_number(le, static_cast<double>(uint64_t{1} << b) * 1e-6);
        } else {
          le += "+Inf";
        }
        w.sample("request_duration_seconds_bucket", a, le + '"', cumulative);
      }
      w.sample("request_duration_seconds_sum", a, label, static_cast<double>(op.time_ns) / 1e9);
      w.sample("request_duration_seconds_count", a, label, op.requests);
    }
  }

  w.per_attachment("connections", "gauge", "NBD connections in their transmission phase.",
                   [](const target::GroupStats& g) { return uint64_t{g.connections.size()}; });
  w.family("connection_start_time_seconds", "gauge",
           "When each live NBD connection began, in seconds since the epoch, by peer.");
  for (const auto& a : attachments) {
    for (const target::LiveConnection& c : a.figures.connections) {
      std::string label = "connection=\"" + std::to_string(c.serial) + "\",peer=\"";
      append_label_value(label, c.peer);
      w.sample("connection_start_time_seconds", a, label + '"',
               std::chrono::duration<double>(c.since.time_since_epoch()).count());
    }
  }
  return std::move(out);
}

}  // namespace shareblk::metrics
