// The latency path's step trace (MoeConfig.profile, Engine::stepTrace) checked against the order its
// events must keep; shared by the MoE case suite and the latency capabilities' tests.
#pragma once

#include <graphep/moe.hpp>

#include <vector>

namespace graphep::test {

// The latency path's step trace (Engine::stepTrace) of rank r: at least one dispatch and one
// combine; in each operation the send CTA's start before its wait's return, and every event no
// later than the step's advance (the launch's last CTA, after every other); the count messages
// and the receive's view of them for a dispatch only; and in stream order each operation's wait
// returning no earlier than the previous operation's advance (its kernel waited for that one).
void expectStepTrace(const std::vector<MoeStepTrace>& steps, int r);

}  // namespace graphep::test
