// The one check the tests make of a refused call: it throws graphep::Error with the expected
// status and a message that names what was wrong.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "engine/error.hpp"

namespace graphep::test {

inline void expectError(const std::function<void()>& f, Status status, const std::string& words) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming '" << words << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

}  // namespace graphep::test
