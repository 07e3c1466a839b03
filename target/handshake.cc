#include "target/handshake.h"

#include <string_view>
#include <vector>

#include "target/nbd_proto.h"

namespace shareblk::target {

namespace {

using namespace nbd;  // NOLINT(google-build-using-namespace): the wire vocabulary

// A client that keeps haggling forever is cut off; real clients send a handful of options.
constexpr int kMaxOptions = 256;

// Reads fields out of one option's payload; any overrun marks the payload invalid.
class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& data) : data_(data) {}
  bool ok() const { return ok_; }
  bool at_end() const { return pos_ == data_.size(); }
  uint16_t u16() { return have(2) ? get16(take(2)) : 0; }
  uint32_t u32() { return have(4) ? get32(take(4)) : 0; }
  std::string str(uint32_t length) {
    if (length > kMaxStringLength || !have(length)) {
      ok_ = false;
      return {};
    }
    const uint8_t* p = take(length);
    return std::string(reinterpret_cast<const char*>(p), length);
  }

 private:
  bool have(size_t n) {
    if (data_.size() - pos_ < n) ok_ = false;
    return ok_;
  }
  const uint8_t* take(size_t n) {
    const uint8_t* p = data_.data() + pos_;
    pos_ += n;
    return p;
  }
  const std::vector<uint8_t>& data_;
  size_t pos_ = 0;
  bool ok_ = true;
};

class Negotiation {
 public:
  Negotiation(ByteStream& stream, ExportCatalog& catalog, Peer peer, TlsUpgrade* tls,
              HandshakeProgress* progress)
      : stream_(&stream),
        catalog_(catalog),
        peer_(std::move(peer)),
        tls_(tls),
        progress_(progress) {}

  std::optional<Session> run();

 private:
  enum class Next { Continue, Transmit, Close };

  Next handle(uint32_t option, const std::vector<uint8_t>& data);
  Next export_name(const std::vector<uint8_t>& data);
  Next info_or_go(uint32_t option, const std::vector<uint8_t>& data);
  Next meta_context(uint32_t option, const std::vector<uint8_t>& data);
  Next list(uint32_t option, const std::vector<uint8_t>& data);
  Next start_tls(uint32_t option, const std::vector<uint8_t>& data);

  void reply(uint32_t option, uint32_t type, std::string_view payload = {});
  void error(uint32_t option, uint32_t type, std::string_view message) {
    reply(option, type, message);
  }
  std::optional<Export> lookup(uint32_t option, const std::string& name);
  bool flush();
  void progressed() {
    if (progress_ != nullptr) progress_->progressed();
  }

  ByteStream* stream_;  // the TLS session's stream after NBD_OPT_STARTTLS
  ExportCatalog& catalog_;
  Peer peer_;
  TlsUpgrade* tls_;
  HandshakeProgress* progress_;
  std::string out_;  // replies are gathered and written before the next read
  bool no_zeroes_ = false;
  Session session_;
  std::optional<std::string> context_export_;  // export the selected contexts were set for
};

void Negotiation::reply(uint32_t option, uint32_t type, std::string_view payload) {
  uint8_t header[kOptionReplyHeaderSize];
  encode_option_reply(header, option, type, static_cast<uint32_t>(payload.size()));
  out_.append(reinterpret_cast<const char*>(header), sizeof header);
  out_.append(payload);
}

bool Negotiation::flush() {
  bool ok = out_.empty() || stream_->write_all(out_.data(), out_.size());
  out_.clear();
  return ok;
}

std::optional<Export> Negotiation::lookup(uint32_t option, const std::string& name) {
  ExportCatalog::Lookup found = catalog_.resolve(name, peer_);
  if (!found.found) {
    if (found.refusal == ExportCatalog::Refusal::Policy) {
      error(option, kRepErrPolicy, "export not available to this client");
    } else if (found.refusal == ExportCatalog::Refusal::TlsRequired && !peer_.tls) {
      error(option, kRepErrTlsReqd, "this export needs TLS: send NBD_OPT_STARTTLS first");
    } else {
      error(option, kRepErrUnknown, "unknown export");
    }
  }
  return found.found;
}

std::optional<Session> Negotiation::run() {
  uint8_t greeting[18];
  put64(greeting, kMagic);
  put64(greeting + 8, kOptMagic);
  put16(greeting + 16, kFlagFixedNewstyle | kFlagNoZeroes);
  if (!stream_->write_all(greeting, sizeof greeting)) return std::nullopt;

  uint8_t flags_bytes[4];
  if (!stream_->read_exact(flags_bytes, 4)) return std::nullopt;
  const uint32_t client_flags = get32(flags_bytes);
  if (client_flags & ~kClientKnownFlags) return std::nullopt;  // MUST close on unknown flags
  no_zeroes_ = (client_flags & kClientNoZeroes) != 0;
  progressed();

  for (int i = 0; i < kMaxOptions; ++i) {
    uint8_t header[kOptionHeaderSize];
    if (!flush() || !stream_->read_exact(header, sizeof header)) return std::nullopt;
    if (get64(header) != kOptMagic) return std::nullopt;
    const uint32_t option = get32(header + 8);
    const uint32_t length = get32(header + 12);
    if (length > kMaxOptionLength) return std::nullopt;  // no real option is this large
    std::vector<uint8_t> data(length);
    if (length > 0 && !stream_->read_exact(data.data(), length)) return std::nullopt;
    progressed();
    switch (handle(option, data)) {
      case Next::Continue:
        break;
      case Next::Transmit:
        if (!flush()) return std::nullopt;
        return std::move(session_);
      case Next::Close:
        flush();
        return std::nullopt;
    }
  }
  return std::nullopt;
}

Negotiation::Next Negotiation::handle(uint32_t option, const std::vector<uint8_t>& data) {
  // FORCEDTLS (proto.md): nothing but STARTTLS and ABORT before TLS; EXPORT_NAME has no
  // error reply, so it ends the session.
  if (tls_ != nullptr && tls_->required() && !peer_.tls && option != kOptStartTls &&
      option != kOptAbort) {
    if (option == kOptExportName) return Next::Close;
    error(option, kRepErrTlsReqd, "this server requires TLS: send NBD_OPT_STARTTLS first");
    return Next::Continue;
  }
  switch (option) {
    case kOptExportName:
      return export_name(data);
    case kOptAbort:
      reply(option, kRepAck);  // proto.md: the server SHOULD acknowledge, then close
      return Next::Close;
    case kOptList:
      return list(option, data);
    case kOptStartTls:
      return start_tls(option, data);
    case kOptInfo:
    case kOptGo:
      return info_or_go(option, data);
    case kOptStructuredReply:
      if (!data.empty()) {
        error(option, kRepErrInvalid, "NBD_OPT_STRUCTURED_REPLY takes no data");
      } else {
        session_.structured_replies = true;
        reply(option, kRepAck);
      }
      return Next::Continue;
    case kOptListMetaContext:
    case kOptSetMetaContext:
      return meta_context(option, data);
    default:
      error(option, kRepErrUnsup, "option not supported");
      return Next::Continue;
  }
}

Negotiation::Next Negotiation::export_name(const std::vector<uint8_t>& data) {
  // No error reply exists for this option: an unknown name ends the connection.
  if (data.size() > kMaxStringLength) return Next::Close;
  std::string name(data.begin(), data.end());
  ExportCatalog::Lookup found = catalog_.resolve(name, peer_);
  if (!found.found) return Next::Close;
  session_.export_name = std::move(name);
  session_.exp = std::move(*found.found);
  session_.transmission_flags = transmission_flags(session_.exp, session_.structured_replies);
  if (context_export_ != session_.export_name) session_.base_allocation = false;
  uint8_t reply_bytes[10 + kExportNameZeroes] = {};
  put64(reply_bytes, session_.exp.volume->size());
  put16(reply_bytes + 8, session_.transmission_flags);
  out_.append(reinterpret_cast<const char*>(reply_bytes), no_zeroes_ ? 10 : sizeof reply_bytes);
  return Next::Transmit;
}

Negotiation::Next Negotiation::start_tls(uint32_t option, const std::vector<uint8_t>& data) {
  if (tls_ == nullptr) {
    error(option, kRepErrUnsup, "TLS is not enabled on this server");
    return Next::Continue;
  }
  if (peer_.tls) {
    error(option, kRepErrInvalid, "TLS is already negotiated");
    return Next::Continue;
  }
  if (!data.empty()) {
    error(option, kRepErrInvalid, "NBD_OPT_STARTTLS takes no data");
    return Next::Continue;
  }
  reply(option, kRepAck);
  if (!flush()) return Next::Close;
  TlsPeer proved;
  ByteStream* secure = tls_->start(proved);
  if (secure == nullptr) return Next::Close;
  stream_ = secure;
  peer_.tls = std::move(proved);
  // Nothing negotiated in the clear carries over (proto.md NBD_OPT_STARTTLS).
  session_ = Session{};
  context_export_.reset();
  return Next::Continue;
}

Negotiation::Next Negotiation::list(uint32_t option, const std::vector<uint8_t>& data) {
  if (!data.empty()) {
    error(option, kRepErrInvalid, "NBD_OPT_LIST takes no data");
    return Next::Continue;
  }
  for (const std::string& name : catalog_.listable()) {
    std::string payload(4, '\0');
    put32(reinterpret_cast<uint8_t*>(payload.data()), static_cast<uint32_t>(name.size()));
    payload += name;
    reply(option, kRepServer, payload);
  }
  reply(option, kRepAck);
  return Next::Continue;
}

Negotiation::Next Negotiation::info_or_go(uint32_t option, const std::vector<uint8_t>& data) {
  Reader in(data);
  std::string name = in.str(in.u32());
  const uint16_t count = in.u16();
  std::vector<uint16_t> requests;
  for (uint16_t i = 0; i < count && in.ok(); ++i) requests.push_back(in.u16());
  if (!in.ok() || !in.at_end()) {
    error(option, kRepErrInvalid, "malformed NBD_OPT_INFO/NBD_OPT_GO");
    return Next::Continue;
  }
  std::optional<Export> exp = lookup(option, name);
  if (!exp) return Next::Continue;

  const uint16_t flags = transmission_flags(*exp, session_.structured_replies);
  uint8_t info[14];
  put16(info, kInfoExport);
  put64(info + 2, exp->volume->size());
  put16(info + 10, flags);
  reply(option, kRepInfo, {reinterpret_cast<char*>(info), 12});
  // Block sizes go out unasked: minimum 1 says any alignment is served (proto.md
  // "Block size constraints"), the maximum bounds a request's payload.
  put16(info, kInfoBlockSize);
  put32(info + 2, 1);
  put32(info + 6, kPreferredBlock);
  put32(info + 10, kMaxPayload);
  reply(option, kRepInfo, {reinterpret_cast<char*>(info), 14});
  for (uint16_t type : requests) {
    std::string payload(2, '\0');
    if (type == kInfoName) {
      put16(reinterpret_cast<uint8_t*>(payload.data()), kInfoName);
      reply(option, kRepInfo, payload + name);
    } else if (type == kInfoDescription && !exp->description.empty()) {
      put16(reinterpret_cast<uint8_t*>(payload.data()), kInfoDescription);
      reply(option, kRepInfo, payload + exp->description);
    }
  }
  reply(option, kRepAck);
  if (option == kOptInfo) return Next::Continue;

  session_.export_name = std::move(name);
  session_.exp = std::move(*exp);
  session_.transmission_flags = flags;
  // Contexts chosen for another export do not carry over (proto.md NBD_OPT_SET_META_CONTEXT).
  if (context_export_ != session_.export_name) session_.base_allocation = false;
  return Next::Transmit;
}

Negotiation::Next Negotiation::meta_context(uint32_t option, const std::vector<uint8_t>& data) {
  if (!session_.structured_replies) {
    error(option, kRepErrInvalid, "negotiate structured replies first");
    return Next::Continue;
  }
  Reader in(data);
  std::string name = in.str(in.u32());
  const uint32_t count = in.u32();
  std::vector<std::string> queries;
  for (uint32_t i = 0; i < count && in.ok(); ++i) queries.push_back(in.str(in.u32()));
  if (!in.ok() || !in.at_end()) {
    error(option, kRepErrInvalid, "malformed metadata context request");
    return Next::Continue;
  }
  const std::optional<Export> exp = lookup(option, name);
  if (!exp) return Next::Continue;

  const bool set = option == kOptSetMetaContext;
  // LIST with no queries lists everything; a "base:" query names the whole namespace.
  bool match = !set && queries.empty();
  for (const std::string& q : queries) {
    if (q == kBaseAllocation || (!set && q == "base:")) match = true;
  }
  match = match && backend::capabilities(*exp->volume, exp->mode).block_status;
  if (set) {
    session_.base_allocation = match;
    context_export_ = name;
  }
  if (match) {
    std::string payload(4, '\0');
    put32(reinterpret_cast<uint8_t*>(payload.data()), set ? kBaseAllocationId : 0);
    reply(option, kRepMetaContext, payload + kBaseAllocation);
  }
  reply(option, kRepAck);
  return Next::Continue;
}

}  // namespace

uint16_t transmission_flags(const Export& exp, bool structured_replies) {
  // What the attachment may do is the backend's rule (backend::capabilities); here it only
  // becomes the wire's flags (proto.md "Transmission flags").
  const backend::Capabilities can = backend::capabilities(*exp.volume, exp.mode);
  uint16_t flags = kFlagHasFlags;
  if (can.read_only) flags |= kFlagReadOnly;
  if (can.flush) flags |= kFlagSendFlush;
  if (can.fua) flags |= kFlagSendFua;
  if (can.cache) flags |= kFlagSendCache;
  if (can.multi_conn && !exp.exclusive) flags |= kFlagCanMultiConn;
  if (can.trim) flags |= kFlagSendTrim;
  if (can.zero) flags |= kFlagSendWriteZeroes;
  if (can.fast_zero) flags |= kFlagSendFastZero;
  if (structured_replies) flags |= kFlagSendDf;
  if (exp.volume->rotational()) flags |= kFlagRotational;
  return flags;
}

std::optional<Session> negotiate(ByteStream& stream, ExportCatalog& catalog, const Peer& peer,
                                 TlsUpgrade* tls, HandshakeProgress* progress) {
  return Negotiation(stream, catalog, peer, tls, progress).run();
}

}  // namespace shareblk::target
