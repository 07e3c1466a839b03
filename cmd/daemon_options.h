// shareblkd's options: their table, where they are read from (the command line, then the
// --config file), and the checks that turn a bad value into one clear message. The daemon
// reads them at start and again on SIGHUP (docs/operations.md, "Reload").
#pragma once

#include <boost/program_options.hpp>
#include <string>
#include <vector>

namespace shareblk::cmd {

namespace po = boost::program_options;

// A whole number given as decimal digits only (no sign, no spaces), at most `Max`. Boost's own
// conversion takes "-1" for an unsigned option and wraps it around; this refuses it, naming
// the option and the range.
template <typename T, T Max>
struct Whole {
  T value = 0;
};
using Count = Whole<unsigned, 1U << 30>;
using Milliseconds = Whole<unsigned, 24U * 3600 * 1000>;  // a day, at most
using MiB = Whole<uint64_t, uint64_t{1} << 40>;
using KiB = Whole<unsigned, 1U << 20>;  // a GiB, at most
using Workers = Whole<unsigned, 256>;

// The options shareblkd shows in --help, with the renamed ones' old spellings hidden beside.
po::options_description daemon_options();

// Reads the command line, then the file --config names (the command line wins where both set
// an option), and checks the values. False with `error` (one line, naming the option) when
// something is wrong. `warnings` gets what the operator should change but that still works:
// an old option name.
bool load_options(int argc, char** argv, po::variables_map& vm, std::vector<std::string>& warnings,
                  std::string& error);

}  // namespace shareblk::cmd
