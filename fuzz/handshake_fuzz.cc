// Fuzzes the server side of the handshake (target::negotiate). The input is everything the
// client sends after the server's greeting; the server's output is checked for framing: the
// greeting, whole option replies, and at most NBD_OPT_EXPORT_NAME's answer after them. A
// session that comes out must agree with the export it names.
//
// Each input runs three times: without TLS, with TLS offered (SELECTIVETLS; export "ro" is
// TLS-only) and with TLS required (FORCEDTLS). NBD_OPT_STARTTLS's upgrade is a stand-in that
// goes on reading the same bytes, so the haggling after it is fuzzed as well; no session may
// come out of a connection that did not start TLS where TLS was needed.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/fuzz_volume.h"
#include "target/handshake.h"
#include "target/nbd_proto.h"
#include "target/target.h"

namespace shareblk::fuzz {
namespace {

using namespace nbd;  // NOLINT(google-build-using-namespace): the wire vocabulary

class InputStream final : public target::ByteStream {
 public:
  InputStream(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool read_exact(void* buf, size_t length) override {
    if (size_ - pos_ < length) return false;
    std::memcpy(buf, data_ + pos_, length);
    pos_ += length;
    return true;
  }
  bool write_all(const void* buf, size_t length) override {
    output_.append(static_cast<const char*>(buf), length);
    return true;
  }
  const std::string& output() const { return output_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  std::string output_;
};

// The TLS handshake's stand-in: the same stream goes on, as if it were decrypted.
class FakeTls final : public target::TlsUpgrade {
 public:
  FakeTls(target::ByteStream& stream, bool required) : stream_(stream), required_(required) {}
  bool required() const override { return required_; }
  target::ByteStream* start(target::TlsPeer& proved) override {
    ++started_;
    proved.psk_identity = "fuzz";
    return &stream_;
  }
  int started() const { return started_; }

 private:
  target::ByteStream& stream_;
  bool required_;
  int started_ = 0;
};

// The static exports, with "ro" TLS-only when TLS is offered.
class TlsCatalog final : public target::ExportCatalog {
 public:
  TlsCatalog(target::ExportCatalog& inner, bool tls) : inner_(inner), tls_(tls) {}
  Lookup resolve(const std::string& name, const target::Peer& peer) override {
    if (tls_ && name == "ro" && !peer.tls) return {std::nullopt, Refusal::TlsRequired};
    return inner_.resolve(name, peer);
  }
  std::vector<std::string> listable() override { return inner_.listable(); }

 private:
  target::ExportCatalog& inner_;
  bool tls_;
};

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "handshake_fuzz: %s\n", what);
  std::abort();
}

target::StaticCatalog& catalog() {
  // Made once and never freed: every input runs against the same exports.
  static target::StaticCatalog* made = [] {
    auto* c = new target::StaticCatalog();
    auto volume = scratch_volume(1 << 20);
    c->add("disk", target::Export{volume, backend::AttachMode::ReadWrite, "", "scratch"});
    c->add("ro", target::Export{volume, backend::AttachMode::ReadOnly, "", ""});
    return c;
  }();
  return *made;
}

void check_output(const std::string& out, const std::optional<target::Session>& session) {
  const auto* p = reinterpret_cast<const uint8_t*>(out.data());
  if (out.size() < 18 || get64(p) != kMagic || get64(p + 8) != kOptMagic) fail("bad greeting");
  size_t pos = 18;
  while (out.size() - pos >= kOptionReplyHeaderSize && get64(p + pos) == kOptReplyMagic) {
    const uint32_t length = get32(p + pos + 16);
    pos += kOptionReplyHeaderSize;
    if (out.size() - pos < length) fail("option reply longer than what was written");
    pos += length;
  }
  const size_t rest = out.size() - pos;
  if (rest == 0) return;
  // Only NBD_OPT_EXPORT_NAME answers without a reply header, and it ends the handshake.
  if (!session) fail("unframed output without a session");
  if (rest != 10 && rest != 10 + kExportNameZeroes) fail("export name answer has a bad size");
  if (get64(p + pos) != session->exp.volume->size()) fail("export name answer: wrong size");
  if (get16(p + pos + 8) != session->transmission_flags) fail("export name answer: wrong flags");
}

void check_session(const target::Session& s) {
  if (!s.exp.volume) fail("session without a volume");
  if (s.base_allocation && !s.structured_replies) fail("metadata context without structured");
  if (s.transmission_flags != target::transmission_flags(s.exp, s.structured_replies)) {
    fail("session flags differ from the export's");
  }
  const bool read_only = s.exp.mode == backend::AttachMode::ReadOnly;
  if (read_only != ((s.transmission_flags & kFlagReadOnly) != 0)) fail("read-only flag wrong");
  if (read_only && (s.transmission_flags & (kFlagSendTrim | kFlagSendWriteZeroes))) {
    fail("read-only export offers writes");
  }
}

}  // namespace
}  // namespace shareblk::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shareblk;  // NOLINT(google-build-using-namespace)
  enum class Tls { Off, Offered, Required };
  for (Tls mode : {Tls::Off, Tls::Offered, Tls::Required}) {
    fuzz::InputStream stream(data, size);
    fuzz::FakeTls tls(stream, mode == Tls::Required);
    fuzz::TlsCatalog exports(fuzz::catalog(), mode != Tls::Off);
    std::optional<target::Session> session = target::negotiate(
        stream, exports, target::Peer::tcp("192.0.2.1"), mode == Tls::Off ? nullptr : &tls);
    if (session) fuzz::check_session(*session);
    fuzz::check_output(stream.output(), session);
    if (tls.started() > 1) fuzz::fail("TLS started twice on one connection");
    if (session && tls.started() == 0 &&
        (mode == Tls::Required || (mode == Tls::Offered && session->export_name == "ro"))) {
      fuzz::fail("a TLS-only export was served in the clear");
    }
  }
  return 0;
}
