// The Python Group's C++ state, shared with engine.cpp (engines keep their group alive).
#pragma once

#include <graphep/comm.hpp>

#include <memory>

namespace graphep::python {

struct Group {
  std::shared_ptr<Communicator> comm;
};

}  // namespace graphep::python
