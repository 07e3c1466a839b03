// The `stats` method: the NBD server's per-attachment figures (target::Server::stats) with
// each attachment's volume and mode, and their sums per volume (docs/api.md, docs/metrics.md).
#include <map>

#include "control/service.h"

namespace shareblk::control {

namespace {

std::string iso(std::chrono::system_clock::time_point t) {
  const auto secs = std::chrono::system_clock::to_time_t(t);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

Json io_json(const target::IoStats& io) {
  using target::IoStats;
  Json ops = Json::object();
  for (size_t k = 0; k < IoStats::kKinds; ++k) {
    const IoStats::Op& op = io.ops[k];
    Json latency = Json::array();  // the buckets that counted something
    for (size_t b = 0; b < IoStats::kBuckets; ++b) {
      if (op.latency[b] == 0) continue;
      latency.push_back({{"le_us", b + 1 < IoStats::kBuckets ? Json(uint64_t{1} << b) : Json()},
                         {"count", op.latency[b]}});
    }
    ops[IoStats::kind_name(k)] = {{"requests", op.requests},
                                  {"bytes", op.bytes},
                                  {"errors", op.errors},
                                  {"time_seconds", static_cast<double>(op.time_ns) / 1e9},
                                  {"latency", latency}};
  }
  Json errors = Json::object();
  for (const auto& [err, count] : io.errors) errors[target::IoStats::errno_name(err)] = count;
  return {{"ops", ops}, {"errors", errors}, {"refused_writes", io.refused_writes}};
}

}  // namespace

std::vector<AttachmentStats> Service::attachment_stats(const std::string& attachment_id,
                                                       const std::string& volume_id) {
  std::vector<AttachmentRow> rows;
  {
    Database::Transaction tx(db_);
    if (!attachment_id.empty()) {
      rows.push_back(find_attachment(tx, attachment_id));
    } else {
      if (!volume_id.empty()) find_volume(tx, volume_id);
      for (AttachmentRow& a : tx.attachments(volume_id)) {
        if (is_live(a.attach_status)) rows.push_back(std::move(a));
      }
    }
  }
  std::map<std::string, target::GroupStats> groups;
  for (target::GroupStats& g : exports_.stats()) {
    std::string group = g.group;
    groups.emplace(std::move(group), std::move(g));
  }
  std::vector<AttachmentStats> out;
  out.reserve(rows.size());
  for (const AttachmentRow& a : rows) {
    AttachmentStats s{a.id, a.volume_id, std::string(to_string(a.mode)), {}};
    if (auto it = groups.find(a.id); it != groups.end()) s.figures = std::move(it->second);
    s.figures.group = a.id;
    out.push_back(std::move(s));
  }
  return out;
}

Json Service::stats(const std::string& attachment_id, const std::string& volume_id) {
  if (!attachment_id.empty() && !volume_id.empty()) {
    invalid("give 'attachment_id' or 'volume_id', not both");
  }
  const std::vector<AttachmentStats> all = attachment_stats(attachment_id, volume_id);
  const auto now = std::chrono::system_clock::now();
  Json attachments = Json::array();
  std::map<std::string, std::pair<target::IoStats, size_t>> volumes;  // figures, connections
  if (!volume_id.empty()) volumes[volume_id];  // shown even with no live attachment
  for (const AttachmentStats& a : all) {
    Json connections = Json::array();
    for (const target::LiveConnection& c : a.figures.connections) {
      connections.push_back({{"peer", c.peer}, {"since", iso(c.since)}});
    }
    Json shown = io_json(a.figures.io);
    shown["attachment_id"] = a.attachment_id;
    shown["volume_id"] = a.volume_id;
    shown["mode"] = a.mode;
    shown["connections"] = connections;
    attachments.push_back(std::move(shown));
    auto& [io, count] = volumes[a.volume_id];
    io += a.figures.io;
    count += a.figures.connections.size();
  }
  Json volume_list = Json::array();
  for (const auto& [id, sums] : volumes) {
    Json shown = io_json(sums.first);
    shown["volume_id"] = id;
    shown["connections"] = sums.second;
    volume_list.push_back(std::move(shown));
  }
  return {{"since", iso(started_)},
          {"uptime_seconds", std::chrono::duration<double>(now - started_).count()},
          {"attachments", attachments},
          {"volumes", volume_list}};
}

}  // namespace shareblk::control
