#pragma once
// The operator-level policy of one kNonReentrant region (CheckpointOptions::policy; op_policy.cpp). In the
// forward pass it intercepts fn's operators, asks the policy about each call that can be kept, after the
// call ran (the outermost kept call wins; nothing inside a kept call is asked), and keeps what the policy
// keeps, with what autograd saved inside. In the recompute it hands the kept calls back in the same order
// instead of running them.

#include <remat/policy.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "autograd/hooks.h"
#include "autograd/watch.h"
#include "checkpoint/kept.h"
#include "checkpoint/region.h"

namespace remat::detail {

/// Whether a call of this operator can be kept, and so is asked by a region's policy: every return a tensor
/// that aliases nothing, no argument written, at least one tensor argument, and not a factory.
bool askable(const c10::FunctionSchema& schema);
/// The name of an asked call of `schema`'s operator (OpCall::call, SavedGroup::name): its qualified name,
/// '#', and how many of its calls were named before it in the same pass (`counts`, per operator, advanced
/// here). The region's policy, the profiler's groups and its peaks before them name calls with it, so that a
/// group assignment's names are the ones its policy sees.
std::string call_name(const c10::FunctionSchema& schema, std::unordered_map<std::string, int64_t>& counts);
/// The tensors among boxed values (a call's arguments or returns), lists' elements one by one.
std::vector<at::Tensor> tensors_of(c10::ArrayRef<c10::IValue> values);
/// A tensor's storage, as a key (null for an undefined tensor or one without storage).
const void* storage_key(const at::Tensor& t);

class OpPolicyRecord {
 public:
  /// `offloading`: a remat::Offload scope is open around the region (its kept_sink), which takes the host
  /// answers' outputs (and the kPreferSave ones) once the forward pass is done.
  OpPolicyRecord(Policy policy, bool preserve_rng, std::vector<c10::DeviceIndex> cuda_devices,
                 bool offloading = false);
  ~OpPolicyRecord();
  OpPolicyRecord(const OpPolicyRecord&) = delete;
  OpPolicyRecord& operator=(const OpPolicyRecord&) = delete;

  const Policy& policy() const { return policy_; }

  /// The interceptor of the region's forward pass (install it with an InterceptScope around fn).
  OpInterceptor* forward_interceptor();
  /// A tensor autograd saves during the forward pass (the frame's pack hook): it belongs to the asked calls
  /// running now, if any.
  void saved(const at::Tensor& t);
  /// The forward pass is over: what it kept is final. With a sink (an enclosing Offload's hooks, see
  /// HookSource::kept_sink), the kept calls' tensors are sent there, but those answered kMustSave.
  void forward_done(HookSource* sink = nullptr);

  /// The interceptor of one recompute: kept calls are handed back through `save` (what autograd saved inside
  /// them, as the recompute's pack hook would have saved it). A recompute during the forward pass (fn takes a
  /// gradient of its own results) runs every call.
  std::unique_ptr<OpInterceptor> recompute_interceptor(std::function<void(const at::Tensor&)> save);

  /// While alive: the operators this thread calls are not asked about (inside a remat::keep call that the
  /// region keeps, or hands back, or runs again in place of a released one).
  class Pause {
   public:
    explicit Pause(OpPolicyRecord* record);
    ~Pause();
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

   private:
    OpPolicyRecord* record_;
  };

  /// How many calls the forward pass kept (and still holds).
  int64_t kept_calls() const;

  struct Call;  // one asked call of the forward pass (op_policy.cpp)
  class Forward;
  class Replay;

 private:
  Policy policy_;
  bool preserve_rng_;
  std::vector<c10::DeviceIndex> cuda_devices_;
  std::vector<Call> calls_;  // every asked call of the forward pass, in the order asked
  std::unordered_map<std::string, int64_t> counts_;  // per operator, its asked calls so far (Call::call)
  std::vector<KeptCall> kept_;                       // the kept ones (Call::kept indexes this)
  std::vector<int64_t> kept_call_;                   // kept_ index -> calls_ index
  std::vector<char> must_stay_;  // kept_ index -> answered kMustSave (never sent to the sink)
  bool offloading_ = false;
  std::vector<int64_t> open_;         // asked calls running now (forward pass), outermost first
  std::vector<at::Tensor> captured_;  // what autograd saved while an asked call ran
  std::unordered_map<const void*, int64_t> kept_storages_;      // a kept output's storage -> its kept_ index
  std::unordered_map<int64_t, std::vector<int64_t>> absorbed_;  // kept_ index -> the writes made part of it
  // Released kept calls (their calls_ index, the warning), reported unless an enclosing call keeps them.
  std::vector<std::pair<int64_t, std::string>> pending_warnings_;
  int paused_ = 0;
  bool forward_done_ = false;
  std::unique_ptr<Forward> forward_;

  friend class Forward;
  friend class Replay;
};

}  // namespace remat::detail
