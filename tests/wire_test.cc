// The NBD wire codec and the server side of the handshake, driven through an in-memory stream:
// the client's bytes are scripted up front and everything the server writes is recorded.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "target/handshake.h"
#include "target/nbd_proto.h"
#include "target/target.h"
#include "tests/support.h"

namespace shareblk {
namespace {

using target::ByteStream;
using target::Export;
using target::Session;

const uint8_t* bytes_of(const std::string& s) {
  return reinterpret_cast<const uint8_t*>(s.data());
}

std::string be16(uint16_t v) {
  std::string s(2, '\0');
  nbd::put16(reinterpret_cast<uint8_t*>(s.data()), v);
  return s;
}
std::string be32(uint32_t v) {
  std::string s(4, '\0');
  nbd::put32(reinterpret_cast<uint8_t*>(s.data()), v);
  return s;
}
std::string be64(uint64_t v) {
  std::string s(8, '\0');
  nbd::put64(reinterpret_cast<uint8_t*>(s.data()), v);
  return s;
}

// --- Codec ---

TEST(Codec, PutWritesBigEndian) {
  uint8_t b[8] = {};
  nbd::put16(b, 0x1234);
  EXPECT_EQ(b[0], 0x12);
  EXPECT_EQ(b[1], 0x34);
  nbd::put32(b, 0x89abcdef);
  const uint8_t want32[] = {0x89, 0xab, 0xcd, 0xef};
  EXPECT_EQ(std::memcmp(b, want32, 4), 0);
  nbd::put64(b, 0x0102030405060708);
  const uint8_t want64[] = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_EQ(std::memcmp(b, want64, 8), 0);
}

TEST(Codec, GetReadsBigEndian) {
  const uint8_t b[] = {0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10};
  EXPECT_EQ(nbd::get16(b), 0xfedc);
  EXPECT_EQ(nbd::get32(b), 0xfedcba98u);
  EXPECT_EQ(nbd::get64(b), 0xfedcba9876543210u);
}

TEST(Codec, RoundTripsExtremes) {
  uint8_t b[8];
  for (uint16_t v : {uint16_t{0}, uint16_t{1}, uint16_t{0x8000}, uint16_t{0xffff}}) {
    nbd::put16(b, v);
    EXPECT_EQ(nbd::get16(b), v);
  }
  for (uint32_t v : {0u, 1u, 0x80000000u, 0xffffffffu, 0x00ff00ffu}) {
    nbd::put32(b, v);
    EXPECT_EQ(nbd::get32(b), v);
  }
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 63, ~uint64_t{0},
                     uint64_t{0x00000000ffffffff}, uint64_t{0xffffffff00000000}}) {
    nbd::put64(b, v);
    EXPECT_EQ(nbd::get64(b), v);
  }
}

TEST(Codec, MagicsSpellTheirNames) {
  uint8_t b[8];
  nbd::put64(b, nbd::kMagic);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(b), 8), "NBDMAGIC");
  nbd::put64(b, nbd::kOptMagic);
  EXPECT_EQ(std::string(reinterpret_cast<char*>(b), 8), "IHAVEOPT");
}

TEST(Codec, RequestRoundTripAndLayout) {
  const nbd::Request in{nbd::kRequestMagic, nbd::kCmdFlagFua,   nbd::kCmdWrite,
                        0x1122334455667788, 0xa0b0c0d0e0f00010, 0xdeadbeef};
  uint8_t b[nbd::kRequestSize + 1];
  b[nbd::kRequestSize] = 0x5a;  // must stay untouched
  nbd::encode_request(b, in);
  EXPECT_EQ(b[nbd::kRequestSize], 0x5a);
  const uint8_t want[nbd::kRequestSize] = {
      0x25, 0x60, 0x95, 0x13,                          // magic
      0x00, 0x01,                                      // flags
      0x00, 0x01,                                      // type
      0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88,  // cookie
      0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0, 0x00, 0x10,  // offset
      0xde, 0xad, 0xbe, 0xef,                          // length
  };
  EXPECT_EQ(std::memcmp(b, want, sizeof want), 0);
  const nbd::Request out = nbd::decode_request(b);
  EXPECT_EQ(out.magic, in.magic);
  EXPECT_EQ(out.flags, in.flags);
  EXPECT_EQ(out.type, in.type);
  EXPECT_EQ(out.cookie, in.cookie);
  EXPECT_EQ(out.offset, in.offset);
  EXPECT_EQ(out.length, in.length);
}

TEST(Codec, SimpleReplyLayout) {
  uint8_t b[nbd::kSimpleReplySize];
  nbd::encode_simple_reply(b, nbd::kEinval, 0x0102030405060708);
  EXPECT_EQ(nbd::get32(b), nbd::kSimpleReplyMagic);
  EXPECT_EQ(nbd::get32(b + 4), 22u);
  EXPECT_EQ(nbd::get64(b + 8), 0x0102030405060708u);
  EXPECT_EQ(b[0], 0x67);
  EXPECT_EQ(b[15], 0x08);
}

TEST(Codec, ChunkHeaderLayout) {
  uint8_t b[nbd::kChunkHeaderSize];
  nbd::encode_chunk_header(b, nbd::kReplyFlagDone, nbd::kReplyOffsetHole, 42, 12);
  EXPECT_EQ(nbd::get32(b), nbd::kStructuredReplyMagic);
  EXPECT_EQ(nbd::get16(b + 4), nbd::kReplyFlagDone);
  EXPECT_EQ(nbd::get16(b + 6), nbd::kReplyOffsetHole);
  EXPECT_EQ(nbd::get64(b + 8), 42u);
  EXPECT_EQ(nbd::get32(b + 16), 12u);
}

TEST(Codec, OptionReplyLayout) {
  uint8_t b[nbd::kOptionReplyHeaderSize];
  nbd::encode_option_reply(b, nbd::kOptGo, nbd::kRepErrUnknown, 7);
  EXPECT_EQ(nbd::get64(b), nbd::kOptReplyMagic);
  EXPECT_EQ(nbd::get32(b + 8), 7u);
  EXPECT_EQ(nbd::get32(b + 12), 0x80000006u);  // error bit and NBD_REP_ERR_UNKNOWN's 6
  EXPECT_EQ(nbd::get32(b + 16), 7u);
}

TEST(Codec, SizesAndValuesMatchTheSpec) {
  EXPECT_EQ(nbd::kRequestSize, 28u);
  EXPECT_EQ(nbd::kSimpleReplySize, 16u);
  EXPECT_EQ(nbd::kChunkHeaderSize, 20u);
  EXPECT_EQ(nbd::kOptionHeaderSize, 16u);
  EXPECT_EQ(nbd::kOptionReplyHeaderSize, 20u);
  EXPECT_EQ(nbd::kExportNameZeroes, 124u);
  EXPECT_EQ(nbd::kRepErrUnsup, 0x80000001u);
  EXPECT_EQ(nbd::kRepErrInvalid, 0x80000003u);
  EXPECT_EQ(nbd::kRepErrTooBig, 0x80000009u);
  EXPECT_EQ(nbd::kFlagSendFastZero, 1u << 11);
  EXPECT_EQ(nbd::kReplyError, 32769u);
  EXPECT_EQ(nbd::kReplyErrorOffset, 32770u);
}

// --- Handshake ---

// Serves scripted client bytes and records what the server writes. Once the script is used up
// reads fail, as a closed socket's would.
class ScriptedStream final : public ByteStream {
 public:
  explicit ScriptedStream(std::string input) : input_(std::move(input)) {}

  bool read_exact(void* buf, size_t length) override {
    if (input_.size() - pos_ < length) {
      pos_ = input_.size();
      return false;
    }
    std::memcpy(buf, input_.data() + pos_, length);
    pos_ += length;
    return true;
  }
  bool write_all(const void* buf, size_t length) override {
    if (fail_writes_) return false;
    output_.append(static_cast<const char*>(buf), length);
    return true;
  }

  void fail_writes() { fail_writes_ = true; }
  const std::string& output() const { return output_; }
  size_t unread() const { return input_.size() - pos_; }

 private:
  std::string input_;
  size_t pos_ = 0;
  std::string output_;
  bool fail_writes_ = false;
};

// Builds what a client sends: its flags, then options.
class ClientScript {
 public:
  explicit ClientScript(uint32_t flags = nbd::kClientFixedNewstyle | nbd::kClientNoZeroes) {
    bytes_ = be32(flags);
  }
  ClientScript& option(uint32_t option, const std::string& payload = {}) {
    bytes_ += be64(nbd::kOptMagic) + be32(option) + be32(static_cast<uint32_t>(payload.size()));
    bytes_ += payload;
    return *this;
  }
  // NBD_OPT_GO / NBD_OPT_INFO payload.
  static std::string info_request(const std::string& name, const std::vector<uint16_t>& infos) {
    std::string p = be32(static_cast<uint32_t>(name.size())) + name;
    p += be16(static_cast<uint16_t>(infos.size()));
    for (uint16_t i : infos) p += be16(i);
    return p;
  }
  ClientScript& go(const std::string& name, const std::vector<uint16_t>& infos = {}) {
    return option(nbd::kOptGo, info_request(name, infos));
  }
  // NBD_OPT_{LIST,SET}_META_CONTEXT payload.
  static std::string meta_request(const std::string& name,
                                  const std::vector<std::string>& queries) {
    std::string p = be32(static_cast<uint32_t>(name.size())) + name;
    p += be32(static_cast<uint32_t>(queries.size()));
    for (const std::string& q : queries) p += be32(static_cast<uint32_t>(q.size())) + q;
    return p;
  }
  ClientScript& raw(const std::string& bytes) {
    bytes_ += bytes;
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

struct OptionReply {
  uint32_t option = 0;
  uint32_t type = 0;
  std::string payload;
};

// Splits what the server wrote after its greeting into option replies. Bytes that do not start
// with the reply magic (NBD_OPT_EXPORT_NAME's answer) are left in `rest`.
struct ServerOutput {
  std::string greeting;
  std::vector<OptionReply> replies;
  std::string rest;
  bool well_formed = true;
};

ServerOutput parse_output(const std::string& out) {
  ServerOutput parsed;
  parsed.greeting = out.substr(0, 18);
  size_t pos = std::min<size_t>(18, out.size());
  while (out.size() - pos >= nbd::kOptionReplyHeaderSize &&
         nbd::get64(bytes_of(out) + pos) == nbd::kOptReplyMagic) {
    const uint8_t* h = bytes_of(out) + pos;
    OptionReply r{nbd::get32(h + 8), nbd::get32(h + 12), {}};
    const uint32_t length = nbd::get32(h + 16);
    pos += nbd::kOptionReplyHeaderSize;
    if (out.size() - pos < length) {
      parsed.well_formed = false;
      break;
    }
    r.payload = out.substr(pos, length);
    pos += length;
    parsed.replies.push_back(std::move(r));
  }
  parsed.rest = out.substr(pos);
  return parsed;
}

constexpr uint64_t kDiskSize = 1 << 20;
constexpr uint64_t kRoSize = 3 * 4096;

class HandshakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    disk_ = open_volume("disk.img", kDiskSize);
    ro_ = open_volume("ro.img", kRoSize);
    ASSERT_TRUE(disk_ && ro_);
    catalog_.add("disk", Export{disk_, backend::AttachMode::ReadWrite, "", "scratch disk"});
    catalog_.add("ro", Export{ro_, backend::AttachMode::ReadOnly, "", ""});
  }

  std::shared_ptr<backend::Volume> open_volume(const std::string& name, uint64_t size) {
    testing::make_file(dir_ / name, size);
    std::error_code ec;
    auto v = backend::Volume::open(dir_ / name, ec);
    EXPECT_FALSE(ec) << ec.message();
    return v;
  }

  // Runs the handshake over `script`; the server's output lands in `output_`.
  std::optional<Session> run(const ClientScript& script) {
    ScriptedStream stream(script.bytes());
    std::optional<Session> session = negotiate(stream, catalog_, target::Peer{});
    output_ = parse_output(stream.output());
    unread_ = stream.unread();
    return session;
  }

  testing::TempDir dir_;
  std::shared_ptr<backend::Volume> disk_;
  std::shared_ptr<backend::Volume> ro_;
  target::StaticCatalog catalog_;
  ServerOutput output_;
  size_t unread_ = 0;
};

// Checks that `r` is an NBD_INFO_EXPORT reply and returns its transmission flags.
uint16_t expect_info_export(const OptionReply& r, uint32_t option, uint64_t size) {
  EXPECT_EQ(r.option, option);
  EXPECT_EQ(r.type, nbd::kRepInfo);
  if (r.payload.size() != 12) {
    ADD_FAILURE() << "NBD_INFO_EXPORT payload is " << r.payload.size() << " bytes";
    return 0;
  }
  EXPECT_EQ(nbd::get16(bytes_of(r.payload)), nbd::kInfoExport);
  EXPECT_EQ(nbd::get64(bytes_of(r.payload) + 2), size);
  return nbd::get16(bytes_of(r.payload) + 10);
}

void expect_block_size(const OptionReply& r, uint32_t option) {
  EXPECT_EQ(r.option, option);
  EXPECT_EQ(r.type, nbd::kRepInfo);
  ASSERT_EQ(r.payload.size(), 14u);
  const uint8_t* p = bytes_of(r.payload);
  EXPECT_EQ(nbd::get16(p), nbd::kInfoBlockSize);
  const uint32_t minimum = nbd::get32(p + 2);
  const uint32_t preferred = nbd::get32(p + 6);
  const uint32_t maximum = nbd::get32(p + 10);
  EXPECT_EQ(minimum, 1u);
  EXPECT_EQ(preferred, nbd::kPreferredBlock);
  EXPECT_EQ(maximum, nbd::kMaxPayload);
  EXPECT_LE(minimum, preferred);
  EXPECT_LE(preferred, maximum);
}

void expect_reply(const OptionReply& r, uint32_t option, uint32_t type) {
  EXPECT_EQ(r.option, option);
  EXPECT_EQ(r.type, type) << std::hex << "got 0x" << r.type << ", want 0x" << type;
}

TEST_F(HandshakeTest, GreetingIsFixedNewstyleWithNoZeroes) {
  // The client hangs up at once: the greeting still went out, and nothing else did.
  ScriptedStream stream("");
  EXPECT_FALSE(negotiate(stream, catalog_, target::Peer{}));
  const std::string want = std::string("NBDMAGICIHAVEOPT") + '\0' + '\3';
  EXPECT_EQ(stream.output(), want);
}

TEST_F(HandshakeTest, UnknownClientFlagsCloseAtOnce) {
  ClientScript script(nbd::kClientFixedNewstyle | 1u << 5);
  script.go("disk");  // never read
  EXPECT_FALSE(run(script));
  EXPECT_EQ(output_.greeting.size(), 18u);
  EXPECT_TRUE(output_.replies.empty());
  EXPECT_TRUE(output_.rest.empty());
  EXPECT_EQ(unread_, script.bytes().size() - 4);
}

TEST_F(HandshakeTest, GoOnReadWriteExport) {
  std::optional<Session> s = run(ClientScript().go("disk"));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.replies.size(), 3u);
  const uint16_t flags = expect_info_export(output_.replies[0], nbd::kOptGo, kDiskSize);
  expect_block_size(output_.replies[1], nbd::kOptGo);
  expect_reply(output_.replies[2], nbd::kOptGo, nbd::kRepAck);
  EXPECT_TRUE(output_.replies[2].payload.empty());
  EXPECT_TRUE(output_.rest.empty());

  EXPECT_TRUE(flags & nbd::kFlagHasFlags);
  EXPECT_TRUE(flags & nbd::kFlagSendFlush);
  EXPECT_TRUE(flags & nbd::kFlagSendFua);
  EXPECT_TRUE(flags & nbd::kFlagSendTrim);
  EXPECT_TRUE(flags & nbd::kFlagSendWriteZeroes);
  EXPECT_FALSE(flags & nbd::kFlagReadOnly);
  EXPECT_FALSE(flags & nbd::kFlagSendDf) << "DF needs structured replies";

  EXPECT_EQ(s->export_name, "disk");
  EXPECT_EQ(s->exp.volume, disk_);
  EXPECT_EQ(s->exp.mode, backend::AttachMode::ReadWrite);
  EXPECT_EQ(s->exp.group, "disk");
  EXPECT_EQ(s->transmission_flags, flags);
  EXPECT_FALSE(s->structured_replies);
  EXPECT_FALSE(s->base_allocation);
}

TEST_F(HandshakeTest, GoOnReadOnlyExport) {
  std::optional<Session> s = run(ClientScript().go("ro"));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.replies.size(), 3u);
  const uint16_t flags = expect_info_export(output_.replies[0], nbd::kOptGo, kRoSize);
  expect_block_size(output_.replies[1], nbd::kOptGo);
  expect_reply(output_.replies[2], nbd::kOptGo, nbd::kRepAck);
  EXPECT_TRUE(flags & nbd::kFlagHasFlags);
  EXPECT_TRUE(flags & nbd::kFlagReadOnly);
  EXPECT_FALSE(flags & nbd::kFlagSendTrim);
  EXPECT_FALSE(flags & nbd::kFlagSendWriteZeroes);
  EXPECT_FALSE(flags & nbd::kFlagSendFastZero);
  EXPECT_EQ(s->exp.mode, backend::AttachMode::ReadOnly);
  EXPECT_EQ(s->transmission_flags, flags);
}

TEST_F(HandshakeTest, GoAnswersRequestedNameAndDescription) {
  std::optional<Session> s =
      run(ClientScript().go("disk", {nbd::kInfoName, nbd::kInfoDescription}));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.replies.size(), 5u);
  expect_reply(output_.replies[2], nbd::kOptGo, nbd::kRepInfo);
  EXPECT_EQ(output_.replies[2].payload, be16(nbd::kInfoName) + "disk");
  expect_reply(output_.replies[3], nbd::kOptGo, nbd::kRepInfo);
  EXPECT_EQ(output_.replies[3].payload, be16(nbd::kInfoDescription) + "scratch disk");
  expect_reply(output_.replies[4], nbd::kOptGo, nbd::kRepAck);
}

TEST_F(HandshakeTest, InfoDoesNotEndNegotiation) {
  std::optional<Session> s =
      run(ClientScript().option(nbd::kOptInfo, ClientScript::info_request("ro", {})).go("disk"));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.replies.size(), 6u);
  expect_info_export(output_.replies[0], nbd::kOptInfo, kRoSize);
  expect_block_size(output_.replies[1], nbd::kOptInfo);
  expect_reply(output_.replies[2], nbd::kOptInfo, nbd::kRepAck);
  expect_info_export(output_.replies[3], nbd::kOptGo, kDiskSize);
  EXPECT_EQ(s->export_name, "disk");
}

TEST_F(HandshakeTest, EmptyNameReachesTheOnlyExport) {
  target::StaticCatalog single;
  single.add("only", Export{disk_, backend::AttachMode::ReadWrite, "", ""});
  ScriptedStream stream(ClientScript().go("").bytes());
  std::optional<Session> s = negotiate(stream, single, target::Peer{});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->exp.volume, disk_);
  // With two exports the empty name is ambiguous.
  EXPECT_FALSE(run(ClientScript().go("")));
  ASSERT_FALSE(output_.replies.empty());
  expect_reply(output_.replies[0], nbd::kOptGo, nbd::kRepErrUnknown);
}

TEST_F(HandshakeTest, GoOnUnknownNameIsRefusedAndNegotiationContinues) {
  std::optional<Session> s = run(ClientScript().go("nope").go("disk"));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.replies.size(), 4u);
  expect_reply(output_.replies[0], nbd::kOptGo, nbd::kRepErrUnknown);
  expect_info_export(output_.replies[1], nbd::kOptGo, kDiskSize);
  expect_reply(output_.replies[3], nbd::kOptGo, nbd::kRepAck);
  EXPECT_EQ(s->export_name, "disk");
}

TEST_F(HandshakeTest, PolicyRefusalIsReportedAsPolicy) {
  class Refusing final : public target::ExportCatalog {
   public:
    Lookup resolve(const std::string&, const target::Peer&) override {
      return {std::nullopt, Refusal::Policy};
    }
    std::vector<std::string> listable() override { return {}; }
  } refusing;
  ScriptedStream stream(ClientScript().go("disk").option(nbd::kOptAbort).bytes());
  EXPECT_FALSE(negotiate(stream, refusing, target::Peer{}));
  ServerOutput out = parse_output(stream.output());
  ASSERT_EQ(out.replies.size(), 2u);
  expect_reply(out.replies[0], nbd::kOptGo, nbd::kRepErrPolicy);
  expect_reply(out.replies[1], nbd::kOptAbort, nbd::kRepAck);
}

TEST_F(HandshakeTest, ListNamesEveryExport) {
  EXPECT_FALSE(run(ClientScript().option(nbd::kOptList).option(nbd::kOptAbort)));
  ASSERT_EQ(output_.replies.size(), 4u);
  expect_reply(output_.replies[0], nbd::kOptList, nbd::kRepServer);
  EXPECT_EQ(output_.replies[0].payload, be32(4) + "disk");
  expect_reply(output_.replies[1], nbd::kOptList, nbd::kRepServer);
  EXPECT_EQ(output_.replies[1].payload, be32(2) + "ro");
  expect_reply(output_.replies[2], nbd::kOptList, nbd::kRepAck);
  expect_reply(output_.replies[3], nbd::kOptAbort, nbd::kRepAck);
}

TEST_F(HandshakeTest, ListWithDataIsInvalid) {
  EXPECT_TRUE(run(ClientScript().option(nbd::kOptList, "x").go("disk")));
  ASSERT_FALSE(output_.replies.empty());
  expect_reply(output_.replies[0], nbd::kOptList, nbd::kRepErrInvalid);
}

TEST_F(HandshakeTest, StartTlsIsUnsupported) {
  EXPECT_TRUE(run(ClientScript().option(nbd::kOptStartTls).go("disk")));
  ASSERT_EQ(output_.replies.size(), 4u);
  expect_reply(output_.replies[0], nbd::kOptStartTls, nbd::kRepErrUnsup);
  expect_reply(output_.replies[3], nbd::kOptGo, nbd::kRepAck);
}

TEST_F(HandshakeTest, UnknownOptionsAreUnsupported) {
  const uint32_t unknown[] = {nbd::kOptPeekExport, nbd::kOptExtendedHeaders, 0, 12, 0x7fffffff,
                              0xffffffff};
  ClientScript script;
  for (uint32_t option : unknown) script.option(option, "some payload");
  std::optional<Session> s = run(script.go("disk"));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.replies.size(), std::size(unknown) + 3);
  for (size_t i = 0; i < std::size(unknown); ++i) {
    expect_reply(output_.replies[i], unknown[i], nbd::kRepErrUnsup);
  }
}

TEST_F(HandshakeTest, MalformedGoIsInvalid) {
  const std::string good = ClientScript::info_request("disk", {nbd::kInfoName});
  const std::string malformed[] = {
      "",                                    // no name length
      be32(5) + "disk" + be16(0),            // name runs into the count
      be32(100) + "disk",                    // name longer than the payload
      be32(4) + "disk",                      // no info count
      be32(4) + "disk" + be16(2) + be16(1),  // fewer requests than counted
      good + "x",                            // trailing byte
      be32(nbd::kMaxStringLength + 1) + std::string(nbd::kMaxStringLength + 1, 'a') + be16(0),
  };
  ClientScript script;
  for (const std::string& payload : malformed) script.option(nbd::kOptGo, payload);
  std::optional<Session> s = run(script.go("disk"));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.replies.size(), std::size(malformed) + 3);
  for (size_t i = 0; i < std::size(malformed); ++i) {
    SCOPED_TRACE(i);
    expect_reply(output_.replies[i], nbd::kOptGo, nbd::kRepErrInvalid);
  }
}

TEST_F(HandshakeTest, StructuredReplyWithDataIsInvalid) {
  std::optional<Session> s = run(ClientScript().option(nbd::kOptStructuredReply, "x").go("disk"));
  ASSERT_TRUE(s);
  expect_reply(output_.replies[0], nbd::kOptStructuredReply, nbd::kRepErrInvalid);
  EXPECT_FALSE(s->structured_replies);
}

TEST_F(HandshakeTest, MetaContextNeedsStructuredRepliesFirst) {
  const std::string query = ClientScript::meta_request("disk", {nbd::kBaseAllocation});
  std::optional<Session> s = run(ClientScript()
                                     .option(nbd::kOptSetMetaContext, query)
                                     .option(nbd::kOptListMetaContext, query)
                                     .go("disk"));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.replies.size(), 5u);
  expect_reply(output_.replies[0], nbd::kOptSetMetaContext, nbd::kRepErrInvalid);
  expect_reply(output_.replies[1], nbd::kOptListMetaContext, nbd::kRepErrInvalid);
  EXPECT_FALSE(s->base_allocation);
}

TEST_F(HandshakeTest, SetMetaContextSelectsBaseAllocation) {
  std::optional<Session> s = run(
      ClientScript()
          .option(nbd::kOptStructuredReply)
          .option(nbd::kOptSetMetaContext,
                  ClientScript::meta_request("disk", {"qemu:dirty-bitmap:x", nbd::kBaseAllocation}))
          .go("disk"));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.replies.size(), 6u);
  expect_reply(output_.replies[0], nbd::kOptStructuredReply, nbd::kRepAck);
  expect_reply(output_.replies[1], nbd::kOptSetMetaContext, nbd::kRepMetaContext);
  EXPECT_EQ(output_.replies[1].payload, be32(target::kBaseAllocationId) + "base:allocation");
  expect_reply(output_.replies[2], nbd::kOptSetMetaContext, nbd::kRepAck);
  const uint16_t flags = expect_info_export(output_.replies[3], nbd::kOptGo, kDiskSize);
  EXPECT_TRUE(flags & nbd::kFlagSendDf);
  EXPECT_TRUE(s->structured_replies);
  EXPECT_TRUE(s->base_allocation);
  EXPECT_EQ(s->transmission_flags, flags);
}

TEST_F(HandshakeTest, ListMetaContextUsesIdZero) {
  EXPECT_TRUE(run(ClientScript()
                      .option(nbd::kOptStructuredReply)
                      .option(nbd::kOptListMetaContext, ClientScript::meta_request("disk", {}))
                      .go("disk")));
  ASSERT_GE(output_.replies.size(), 3u);
  expect_reply(output_.replies[1], nbd::kOptListMetaContext, nbd::kRepMetaContext);
  EXPECT_EQ(output_.replies[1].payload, be32(0) + "base:allocation");
  expect_reply(output_.replies[2], nbd::kOptListMetaContext, nbd::kRepAck);
}

TEST_F(HandshakeTest, MetaContextOfAnotherExportDoesNotCarryOver) {
  std::optional<Session> s = run(
      ClientScript()
          .option(nbd::kOptStructuredReply)
          .option(nbd::kOptSetMetaContext, ClientScript::meta_request("ro", {nbd::kBaseAllocation}))
          .go("disk"));
  ASSERT_TRUE(s);
  EXPECT_TRUE(s->structured_replies);
  EXPECT_FALSE(s->base_allocation);
}

TEST_F(HandshakeTest, SetMetaContextWithoutMatchSelectsNothing) {
  std::optional<Session> s =
      run(ClientScript()
              .option(nbd::kOptStructuredReply)
              .option(nbd::kOptSetMetaContext,
                      ClientScript::meta_request("disk", {"qemu:dirty-bitmap:x"}))
              .go("disk"));
  ASSERT_TRUE(s);
  expect_reply(output_.replies[1], nbd::kOptSetMetaContext, nbd::kRepAck);
  EXPECT_FALSE(s->base_allocation);
}

TEST_F(HandshakeTest, MalformedMetaContextIsInvalid) {
  std::optional<Session> s =
      run(ClientScript()
              .option(nbd::kOptStructuredReply)
              .option(nbd::kOptSetMetaContext, be32(4) + "disk" + be32(3) + be32(1) + "x")
              .go("disk"));
  ASSERT_TRUE(s);
  expect_reply(output_.replies[1], nbd::kOptSetMetaContext, nbd::kRepErrInvalid);
  EXPECT_FALSE(s->base_allocation);
}

TEST_F(HandshakeTest, ExportNameWithZeroes) {
  std::optional<Session> s =
      run(ClientScript(nbd::kClientFixedNewstyle).option(nbd::kOptExportName, "disk"));
  ASSERT_TRUE(s);
  EXPECT_TRUE(output_.replies.empty());
  ASSERT_EQ(output_.rest.size(), 10u + 124u);
  EXPECT_EQ(nbd::get64(bytes_of(output_.rest)), kDiskSize);
  const uint16_t flags = nbd::get16(bytes_of(output_.rest) + 8);
  EXPECT_EQ(flags, s->transmission_flags);
  EXPECT_FALSE(flags & nbd::kFlagReadOnly);
  EXPECT_EQ(output_.rest.substr(10), std::string(124, '\0'));
  EXPECT_EQ(s->export_name, "disk");
}

TEST_F(HandshakeTest, ExportNameWithNoZeroes) {
  std::optional<Session> s = run(ClientScript().option(nbd::kOptExportName, "ro"));
  ASSERT_TRUE(s);
  ASSERT_EQ(output_.rest.size(), 10u);
  EXPECT_EQ(nbd::get64(bytes_of(output_.rest)), kRoSize);
  EXPECT_TRUE(nbd::get16(bytes_of(output_.rest) + 8) & nbd::kFlagReadOnly);
  EXPECT_EQ(s->exp.mode, backend::AttachMode::ReadOnly);
}

TEST_F(HandshakeTest, ExportNameOfUnknownExportCloses) {
  EXPECT_FALSE(run(ClientScript().option(nbd::kOptExportName, "nope")));
  EXPECT_TRUE(output_.replies.empty());
  EXPECT_TRUE(output_.rest.empty());
}

TEST_F(HandshakeTest, AbortIsAcknowledged) {
  ClientScript script;
  script.option(nbd::kOptAbort).go("disk");  // nothing after ABORT is read
  EXPECT_FALSE(run(script));
  ASSERT_EQ(output_.replies.size(), 1u);
  expect_reply(output_.replies[0], nbd::kOptAbort, nbd::kRepAck);
  EXPECT_TRUE(output_.rest.empty());
  EXPECT_GT(unread_, 0u);
}

TEST_F(HandshakeTest, OptionLengthLimit) {
  // At the limit the payload is read and the option answered; one byte more ends it.
  std::optional<Session> s =
      run(ClientScript().option(0x1234, std::string(nbd::kMaxOptionLength, 'x')).go("disk"));
  ASSERT_TRUE(s);
  expect_reply(output_.replies[0], 0x1234, nbd::kRepErrUnsup);

  ClientScript oversized;
  oversized.raw(be64(nbd::kOptMagic) + be32(nbd::kOptGo) + be32(nbd::kMaxOptionLength + 1));
  oversized.raw(ClientScript::info_request("disk", {}));
  EXPECT_FALSE(run(oversized));
  EXPECT_TRUE(output_.replies.empty());

  ClientScript huge;
  huge.raw(be64(nbd::kOptMagic) + be32(nbd::kOptList) + be32(0xffffffff));
  EXPECT_FALSE(run(huge));
  EXPECT_TRUE(output_.replies.empty());
}

TEST_F(HandshakeTest, BadOptionMagicCloses) {
  ClientScript script;
  script.raw(be64(nbd::kOptMagic ^ 1) + be32(nbd::kOptList) + be32(0));
  EXPECT_FALSE(run(script));
  EXPECT_TRUE(output_.replies.empty());
}

TEST_F(HandshakeTest, TruncatedInputCloses) {
  ClientScript full;
  full.option(nbd::kOptStructuredReply)
      .option(nbd::kOptSetMetaContext, ClientScript::meta_request("disk", {nbd::kBaseAllocation}))
      .option(nbd::kOptList)
      .go("disk", {nbd::kInfoName});
  ASSERT_TRUE(run(full));
  const std::string& bytes = full.bytes();
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    ScriptedStream stream(bytes.substr(0, cut));
    EXPECT_FALSE(negotiate(stream, catalog_, target::Peer{})) << "cut at " << cut;
    EXPECT_TRUE(parse_output(stream.output()).well_formed);
  }
}

TEST_F(HandshakeTest, EndlessHagglingIsCutOff) {
  ClientScript script;
  for (int i = 0; i < 10000; ++i) script.option(nbd::kOptStartTls);
  EXPECT_FALSE(run(script.go("disk")));
  EXPECT_GT(unread_, 0u);
}

TEST_F(HandshakeTest, WriteFailureCloses) {
  ScriptedStream stream(ClientScript().go("disk").bytes());
  stream.fail_writes();
  EXPECT_FALSE(negotiate(stream, catalog_, target::Peer{}));
}

TEST(TransmissionFlags, FollowTheExport) {
  testing::TempDir dir;
  testing::make_file(dir / "v", 8192);
  std::error_code ec;
  auto volume = backend::Volume::open(dir / "v", ec);
  ASSERT_TRUE(volume) << ec.message();
  const Export rw{volume, backend::AttachMode::ReadWrite, "", ""};
  const Export ro{volume, backend::AttachMode::ReadOnly, "", ""};
  const uint16_t always = nbd::kFlagHasFlags | nbd::kFlagSendFlush | nbd::kFlagSendFua |
                          nbd::kFlagSendCache | nbd::kFlagCanMultiConn;
  const uint16_t writes = nbd::kFlagSendTrim | nbd::kFlagSendWriteZeroes | nbd::kFlagSendFastZero;
  EXPECT_EQ(target::transmission_flags(rw, false), always | writes);
  EXPECT_EQ(target::transmission_flags(rw, true), always | writes | nbd::kFlagSendDf);
  EXPECT_EQ(target::transmission_flags(ro, false), always | nbd::kFlagReadOnly);
  EXPECT_EQ(target::transmission_flags(ro, true), always | nbd::kFlagReadOnly | nbd::kFlagSendDf);
}

}  // namespace
}  // namespace shareblk
