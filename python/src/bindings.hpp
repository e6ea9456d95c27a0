// The nanobind extension graphep._graphep: one binding function per concept, each in its own file.
// The extension links graphep and nothing of any array framework: arrays cross as raw device
// pointers (the Python layer, graphep/arrays.py, checks their shape, type and device) or as DLPack
// capsules (dlpack.cpp), and engine-owned buffers leave as DLPack views that keep the engine alive.
#pragma once

#include <nanobind/nanobind.h>

namespace graphep::python {

void bindErrors(nanobind::module_& m);  // errors.cpp: Status, graphep::Error -> graphep.Error
void bindConfig(nanobind::module_& m);  // config.cpp: the enums, MoeConfig, memory_requirements
void bindGroup(nanobind::module_& m);   // group.cpp: Group (a Communicator)
void bindEngine(nanobind::module_& m);  // engine.cpp: Engine, create_engines, status and health
void bindDlpack(nanobind::module_& m);  // dlpack.cpp: dlpack_info

}  // namespace graphep::python
