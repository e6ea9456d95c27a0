// graphep::Error crosses into Python as graphep.Error (python/graphep/errors.py) carrying the
// Status and the message that names the bad value. MoeConfig field names in messages are spelled
// as Python spells them (MoeConfig.maxTokensPerRank -> MoeConfig.max_tokens_per_rank).
#include <graphep/status.hpp>

#include <nanobind/stl/string.h>

#include <cctype>
#include <string>

#include "bindings.hpp"

namespace nb = nanobind;

namespace graphep::python {
namespace {

// "maxTokensPerRank" -> "max_tokens_per_rank": the rule config.cpp names the Python fields by.
std::string snakeCase(const std::string& camel) {
  std::string out;
  for (char c : camel) {
    if (std::isupper(static_cast<unsigned char>(c))) {
      out += '_';
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else {
      out += c;
    }
  }
  return out;
}

std::string pythonSpelling(std::string message) {
  static const std::string kPrefix = "MoeConfig.";
  for (std::size_t at = message.find(kPrefix); at != std::string::npos; at = message.find(kPrefix, at + 1)) {
    const std::size_t begin = at + kPrefix.size();
    std::size_t end = begin;
    while (end < message.size() && std::isalnum(static_cast<unsigned char>(message[end]))) ++end;
    message.replace(begin, end - begin, snakeCase(message.substr(begin, end - begin)));
  }
  return message;
}

}  // namespace

void bindErrors(nb::module_& m) {
  nb::enum_<Status> status(m, "Status", "graphep::Status: what kind of failure a graphep.Error is.");
  for (int s = static_cast<int>(Status::kSuccess); s <= static_cast<int>(Status::kInternalError); ++s) {
    status.value(statusName(static_cast<Status>(s)), static_cast<Status>(s));
  }
  m.def("_python_spelling", &pythonSpelling, "The message with MoeConfig fields spelled as in Python.");

  // The Python class lives in graphep/errors.py (it needs no compiled code); it is looked up when
  // the first error is raised, by which time the package is imported.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      try {
        nb::object cls = nb::module_::import_("graphep.errors").attr("Error");
        nb::object err = cls(nb::cast(e.status()), nb::str(pythonSpelling(e.what()).c_str()));
        PyErr_SetObject(cls.ptr(), err.ptr());
      } catch (const std::exception& inner) {
        PyErr_Format(PyExc_RuntimeError, "%s (graphep.Error could not be raised: %s)", e.what(), inner.what());
      }
    }
  });
}

}  // namespace graphep::python
