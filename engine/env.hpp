// Every GRAPHEP_* environment variable is declared exactly once, in env.cpp, with its type,
// default and help text; graphep-info prints the list. Values are read at setup, never on the run
// path. A malformed value is an error naming the variable and the value.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace graphep::env {

enum class Type { kInt, kBool, kString, kChoice };

struct Info {
  const char* name;
  Type type;
  const char* defaultValue;
  const char* help;
  const char* choices;  // kChoice: "a|b|c"; otherwise nullptr
  long long min;        // kInt bounds (inclusive)
  long long max;
};

const char* typeName(Type t);

class Var {
 public:
  constexpr explicit Var(const Info& info) : info_(info) {}
  const Info& info() const { return info_; }
  // The environment's text, or the default when unset or empty.
  std::string raw() const;
  bool isSet() const;

 protected:
  Info info_;
};

class IntVar : public Var {
 public:
  using Var::Var;
  long long get() const { return parse(raw()); }
  long long parse(std::string_view text) const;
};

class BoolVar : public Var {
 public:
  using Var::Var;
  bool get() const { return parse(raw()); }
  bool parse(std::string_view text) const;
};

class StringVar : public Var {
 public:
  using Var::Var;
  std::string get() const { return raw(); }
};

class ChoiceVar : public Var {
 public:
  using Var::Var;
  std::string get() const { return parse(raw()); }
  std::string parse(std::string_view text) const;  // lower-cased, validated
};

extern const StringVar kDebug;
extern const StringVar kDebugSubsys;
extern const IntVar kTimeoutMs;
extern const BoolVar kTrapOnTimeout;
extern const ChoiceVar kForceTransport;
extern const IntVar kEpilogueCluster;
extern const ChoiceVar kMoeKernels;
extern const IntVar kExchangeChunks;
extern const IntVar kEmulatedNodes;
extern const IntVar kEmulatedNetworkMbps;
extern const ChoiceVar kNodeAware;
extern const StringVar kFaultAfterLaunch;
extern const StringVar kSlowCombineFinal;

// All variables, in declaration order.
const std::vector<const Var*>& all();

}  // namespace graphep::env
