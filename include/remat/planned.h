#pragma once
/// \file
/// Planning in place: remat::Planned takes the place of the loop over a model's blocks. In its first training
/// step it profiles its stages where they sit, on their real input, and measures what the rest of the step
/// (everything after it, the loss, and the backward pass down to its output) holds; from the next step on it
/// runs the plan optimal() finds for the budget.
///
///   // in the model: remat::Planned planned{nullptr};  in its constructor, after the blocks:
///   planned = register_module("planned", remat::Planned(remat::stages_at<BlockImpl>(*this, {"h"}),
///                                                       remat::PlannedOptions().budget(300 << 20)));
///   // in its forward, where the loop over the blocks was:
///   x = planned->forward(x);
///
/// The budget bounds the training step's peak, as remat's meter reads it, above the bytes alive when
/// planned->forward is called: what ran before it (the embeddings and what they saved, the parameters, the
/// gradients, the optimizer's state) is the base, not part of the budget. Planned registers no parameters.
///
/// Every step gives the plain run's loss and gradients and leaves the generators where the plain run does,
/// the profiling step included: the profiler puts the gradients, the buffers and the generators back as they
/// were (and profiles with autocast's cache off, so that its inputs' casts are not held to the end of the
/// caller's autocast region), and that step runs every stage under remat::checkpoint. Every step runs its
/// stages with autocast's cache off, as the plan executor does (a stage leaves no casts there).
///
/// Stages that take per-step extra tensors (BERT's attention mask) are ArgsStageFns; forward(x, {mask})
/// hands the same tensors to every stage of that call (recomputations included).
///
/// Eval mode (Planned's own flag or any stage module's, so model->eval() reaches it registered or not) and
/// NoGradGuard run the stages plainly. A new input shape (the extra tensors' shapes included; and a call of
/// shapes seen before in other dtypes, or under another autocast state, which save other bytes) is profiled
/// again, in its own first training step, unless a planned shape of the same dtypes and autocast state covers
/// it (PlannedOptions::borrow_plans: no size larger, as a shorter sequence); a shape seen before keeps its
/// plan. use_profile() plans from a
/// saved profile instead (chain(), written with to_json(), is the CLI's chain JSON).
///
/// Devices: the CPU (with the counting allocator, remat::memory::track_cpu()) and CUDA (the bytes tensors
/// request from the caching allocator); the input and the extra tensors on one device. Planned measures in
/// remat::memory::PeakWindows: neither remat's peak_bytes() nor the caching allocator's own peak
/// (max_memory_allocated) is reset or lowered. Times that feed the plan are taken with the device
/// synchronized.
///
/// Several calls before one backward pass (a contrastive or paired loss): a training call of forward() that
/// begins while the graph of an earlier one is alive (no backward pass has reached its output, and the
/// output's graph has not been freed) runs inside the earlier call's step: every stage under
/// remat::checkpoint, nothing measured or planned, and a warning (TORCH_WARN) says so once per module. The
/// earlier call's step runs from its base until its own backward pass and those of the calls inside it have
/// ended: its profiling step measures them (their backward passes after its own as the peak after its stages'
/// backward pass), so its plan charges them, and a planned step's last_peak_bytes() includes them. The budget
/// then holds for the calls together. A plan is made for the step as its profiling step ran it (the order of
/// the backward passes, the calls inside).
///
/// Gradient accumulation: a step's backward pass makes the stages' parameter gradients where they are none
/// (after zero_grad, or at an accumulation's first micro-batch) and adds to them where they exist, and the
/// two peak apart by up to the gradients' bytes. Each training call runs the plan for the gradients it begins
/// without, made from the shape's one profile the first time a call begins that way
/// (remat::context_for_grads) and kept. Where the budget fits one state but not the other (the gradients
/// made), the call that begins in the other throws c10::Error naming remat::Planned, the least feasible
/// budget and the gradients, before anything runs; the plan for the first stays in force.

#include <remat/checkpoint.h>
#include <remat/memory.h>
#include <remat/offload.h>
#include <remat/planner/chain.h>
#include <remat/planner/device.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>
#include <remat/planner/step.h>
#include <remat/policy.h>
#include <remat/sequential.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace remat {

struct PlannedOptions {
  /// The step's peak above the bytes alive when forward() is called (bytes, > 0). Give it or fit_device.
  TORCH_ARG(int64_t, budget) = 0;
  /// Instead of a budget in bytes, fit the device: this share, in (0, 1], of what the CUDA device has for the
  /// step, read when each shape's profiling step begins (its free bytes and those its caching allocator holds
  /// beyond its tensors) less what that step lost to fragmentation and a margin: remat::device_budget
  /// (remat/planner/device.h), the rule of the Python package's budget="auto" (1.0) and "90%" (0.9). 0 (the
  /// default): the budget in bytes. A profiling step on a CPU input throws c10::Error naming remat::Planned
  /// and fit_device (a CPU has no capacity to fill: give budget in bytes), before any stage runs.
  TORCH_ARG(double, fit_device) = 0;
  /// How fit_device reads the device; null (the default): remat::memory::device_memory (remat/memory.h).
  /// Tests give a device of their own making, on the CPU too.
  TORCH_ARG(std::function<memory::DeviceMemory(c10::Device)>, read_device) = nullptr;
  /// Operator-level policies profiled as Fk[name], so that the plan may keep a stage's matrix
  /// multiplications (remat/policy.h).
  TORCH_ARG(std::vector<Policy>, policies) = {};
  /// Timed runs per stage in the profile (>= 1); one costs about three plain steps of the stages.
  TORCH_ARG(int64_t, profile_repeats) = 1;
  /// What the planner may use (e.g. exclude Fk; an exclude text the planners cannot read throws c10::Error
  /// at construction). With planner.offload, Planned plans with the per-layer
  /// planner (the one that offloads: each stage kept, kept offloaded, kept under a policy or checkpointed),
  /// profiles each stage for offloading, and runs Fa@host stages under remat::Offload on its host pool
  /// (host_pool()); planner.max_host_bytes bounds that pool's use in the plan.
  TORCH_ARG(PlannerOptions, planner) = {};
  /// With planner.offload: saved tensors smaller than this stay on the device (bytes, >= 0).
  TORCH_ARG(int64_t, offload_min_bytes) = int64_t{1} << 20;
  /// Also profile each stage's saved groups (ProfileOptions::groups) and plan with the per-layer planner,
  /// which may run a stage under a group assignment (Fk3{khr}: each group kept, sent to the host with
  /// planner.offload, or recomputed; remat::group_cost) beside its other ways.
  TORCH_ARG(bool, groups) = false;
  /// Under data parallel, makes every rank plan from the same numbers: called, at the same step on every
  /// rank, with the numbers a plan is made from (remat::plan_figures, remat/planner/step.h: an int64 tensor
  /// of byte counts and flags and a float64 tensor of times and negated bandwidths), it must replace them in
  /// place by their maximum across the ranks. Every rank then gets the same plan, which fits each rank's
  /// measured memory and its slowest link. Throws c10::Error naming remat::Planned when it changes their
  /// number or makes figures no valid chain has (a flag other than 0 or 1).
  /// remat::distributed::same_plan_on_every_rank(group) (remat/distributed.h) is one. It is also called at
  /// the start of each training call with one int64 number (2: this rank's input shape has no plan; 1: it
  /// has none for the parameter gradients this call begins without; else 0): where any rank's shape has
  /// none, every rank profiles that step (one whose shape is planned measures its step again, its profile
  /// kept), and every rank plans at its next call, whatever that call's shape, so that ranks whose batches
  /// differ in shape meet at the same collectives; where any rank has no plan for its gradients, every rank
  /// makes one at this call (a rank that has one meets the collectives with a plan it does not keep). A
  /// budget no plan fits is that shape's error, thrown at its calls.
  TORCH_ARG(std::function<void(std::vector<torch::Tensor>&)>, agree) = nullptr;
  /// When a planned step held more than its plan predicted, beyond kPredictionTolerance (the rule of
  /// remat::check_prediction, remat/planner/step.h), its shape is planned again at its next step, below the
  /// budget by what the step held above the prediction, so that the next plan, held above its own prediction
  /// as much, stays within the budget. Once per input shape (it cannot loop), and a budget only goes down;
  /// where no plan fits the lowered budget, the plan in force is kept. A step that held less is not planned
  /// again for more. The Python package's replan_on_overshoot. Not with agree (one rank's measured peak would
  /// part the ranks' plans): the constructor throws c10::Error naming remat::Planned.
  TORCH_ARG(bool, replan_on_overshoot) = false;
  /// A training step of an input shape not seen before, which a shape with a plan covers (the same number of
  /// tensors, each of the same rank, none of the planned shape's sizes smaller than the new one's:
  /// remat::covering_shape, remat/planner/step.h),
  /// runs the plan of the covering shape with the fewest elements instead of profiling: a sequence shorter
  /// than one planned, or a smaller last batch, costs no profiling step. Its step is measured: where it held
  /// more than that plan's prediction, beyond kPredictionTolerance (a model whose memory does not grow with
  /// its inputs' sizes), a warning (TORCH_WARN) says so and the shape's next training step profiles it. Such
  /// a plan can recompute more than the smaller shape needs; false profiles every new shape. The Python
  /// package's borrow_plans.
  TORCH_ARG(bool, borrow_plans) = true;
  /// A plan of one's own in place of the planner's: called where Planned would plan a shape (after its
  /// profiling step, for each state of the gradients and after replan_on_overshoot), with the shape's
  /// profile, the step's context (remat/planner/step.h: what plan_step() plans from) and the budget (bytes),
  /// it returns the plan to run, which Planned runs, measures and checks as its own: predicted_peak_bytes()
  /// is remat::step_peak_bytes(chain, context, plan), prediction_error() the step against it, and plan()'s
  /// `predicted` is simulate(chain, plan). A plan that assigns groups or streams names them
  /// (Plan::group_names, Plan::stream_windows, from the chain's stages). Benchmarks and tests run plans of
  /// their choosing so (the Python tests' give_plan); a plan made offline (the remat command's) can run so
  /// too. Null (the default): plan_step() with `planner`. Throws c10::Error naming remat::Planned and
  /// choose_plan, before any stage runs under the plan, where the function throws, where the plan is not one
  /// for the chain (simulate()'s std::invalid_argument) or where its predicted peak is above the budget.
  TORCH_ARG(std::function<Plan(const Chain&, const StepContext&, int64_t)>, choose_plan) = nullptr;
};

/// A stage that also takes the per-step extra tensors given to PlannedImpl::forward(x, args), e.g. an
/// attention mask: fn(x, args) returns the stage's output. module, when set, is the module whose
/// parameters and buffers the stage uses (as StageFn::module).
struct ArgsStageFn {
  std::string name;
  std::function<torch::Tensor(const torch::Tensor& x, const std::vector<torch::Tensor>& args)> fn;
  std::shared_ptr<torch::nn::Module> module;
};

/// What Planned measured of the rest of the step in its profiling step.
struct RestOfStep {
  int64_t peak_bytes = 0;  ///< the peak between forward()'s return and the backward pass reaching its output,
                           ///< above what was alive at the return (bytes)
  double ms = 0;           ///< the time between the two (milliseconds)
};

class PlannedImpl : public torch::nn::Module {
 public:
  /// Throws c10::Error naming remat::Planned when `stages` is empty, a stage has no function, or the
  /// budget is not positive.
  PlannedImpl(std::vector<StageFn> stages, PlannedOptions options);
  /// Stages that take the extra tensors of forward(x, args).
  PlannedImpl(std::vector<ArgsStageFn> stages, PlannedOptions options);

  /// Runs the stages on x (each ArgsStageFn also gets `args`): plainly in eval mode or under NoGradGuard;
  /// in training, the plan for the shapes of x and args, or, for shapes without one, a profiling step (then
  /// planned at the next call; with use_profile(), only the rest of the step is measured); a call that begins
  /// while an earlier one's graph is alive runs inside that call's step (above). Throws c10::Error
  /// naming remat::Planned for an undefined input or argument, one on a device other than cpu or cuda, extra
  /// tensors on another device than the input, args given to stages that take
  /// none, and, at planning time, when the budget is below the least feasible one (named in the message;
  /// the step that measured it trained correctly). An out-of-memory error (c10::OutOfMemoryError, or the CPU
  /// allocator's) raised inside a planned step's plan, in its forward or its backward pass, carries remat's
  /// words (remat::describe_out_of_memory: the plan, its predicted peak against the budget, what the step
  /// held, the device's reading, the budget that would have fit).
  torch::Tensor forward(const torch::Tensor& x, const std::vector<torch::Tensor>& args = {});

  /// Plans inputs of `input_shape` (the shapes of x and then of each extra argument, as forward() gets
  /// them) from `chain`, a profile of these stages saved before (load_chain() reads the CLI's JSON), instead
  /// of profiling them: the first training step of that shape runs every stage checkpointed and measures
  /// the rest of the step; the next runs the plan. The profile is taken by the first training call of these
  /// sizes (whatever its dtypes and autocast state: a call of the same sizes in other dtypes or another
  /// autocast state is a shape of its own, profiled); a shape of these sizes seen before but not planned from
  /// a profile of its own (borrowing a plan, or its profiling step not yet done) is dropped for it. Throws
  /// c10::Error naming remat::Planned when the chain's stage count differs from the stages', when validate()
  /// rejects it, or when a plan is already in force for a shape of these sizes; and at that first step, when
  /// the chain's input_bytes differs from the input's.
  void use_profile(const std::vector<std::vector<int64_t>>& input_shape, Chain chain);

  /// Whether a plan is in force for the shape of the last input.
  bool is_planned() const;
  /// The plan in force for the last input's shape, or nullptr.
  const Plan* plan() const;
  /// The profile of the stages for the last input's shape, or nullptr.
  const Chain* chain() const;
  /// The budget in force for the last input's shape (bytes): PlannedOptions::budget, or fit_device's as made
  /// from that shape's profiling step (-1 before it is planned).
  int64_t budget_bytes() const;
  /// The predicted step peak above the base for the plan in force (bytes), or -1.
  int64_t predicted_peak_bytes() const;
  /// The measured step peak above the base of the last planned step, to the end of its backward pass
  /// (bytes), or -1 before one ran.
  int64_t last_peak_bytes() const;
  /// The last planned step's measured peak against the prediction of its plan: (last_peak_bytes() -
  /// predicted_peak_bytes()) / predicted_peak_bytes(), above 0 when the step held more
  /// (remat::check_prediction's error, the rule the Python package follows); nullopt before a planned step of
  /// the last shape was measured. Where it is beyond kPredictionTolerance, the shape's next call warns
  /// (TORCH_WARN, once per input shape and direction, as the Python package does), naming the plan, the
  /// measured and predicted bytes and, above the prediction, the budget (and what replan_on_overshoot did).
  std::optional<double> prediction_error() const;
  /// What replan_on_overshoot took off the budget of the last input's shape (bytes; 0 when it has not planned
  /// that shape again, or found no plan below the lowered budget).
  int64_t budget_lowered_bytes() const;
  /// Training steps run before the plan for the last shape came into force.
  int64_t profiling_steps() const;
  /// How many input shapes have been profiled (each in its own first training step; a shape planned from
  /// use_profile() is not; a shape is a call's key: its tensors' sizes and dtypes, the autocast state and the
  /// stages' parameters, frozen or not, their dtypes and sizes). As the step of the
  /// kProfiledShapesWarnedAt-th (8, remat/planner/step.h) begins, a warning (TORCH_WARN, once per module)
  /// names the shapes and the seconds their profiles took: inputs padded to a few lengths are profiled once
  /// per length.
  int64_t profiled_shapes() const;
  /// How many input shapes run a plan borrowed from a larger shape (PlannedOptions::borrow_plans), not
  /// profiled.
  int64_t borrowed_shapes() const;
  /// Whether the plan in force for the last input's shape is borrowed from a larger shape (its chain(),
  /// predicted_peak_bytes() and step_readings() are then that shape's; its prediction bounds the step).
  bool plan_borrowed() const;
  /// What the profiling step measured of the rest of the step for the last shape, or nullptr.
  const RestOfStep* rest_of_step() const;
  /// The profiling step's readings for the last shape (remat/planner/step.h: what step_context() turned into
  /// the step's model), or nullptr before that step's backward pass ended.
  const StepReadings* step_readings() const;
  /// The host memory of offloaded stages (PlannerOptions::offload), reused from step to step.
  const std::shared_ptr<HostPool>& host_pool() const { return host_pool_; }

 private:
  struct Shape {
    std::optional<Chain> chain;
    // Written by a gradient hook, which may outlive this module: shared with it.
    std::shared_ptr<std::optional<RestOfStep>> rest = std::make_shared<std::optional<RestOfStep>>();
    // The profiling step's readings (remat/planner/step.h), complete at the end of its backward pass.
    std::shared_ptr<std::optional<StepReadings>> readings = std::make_shared<std::optional<StepReadings>>();
    std::optional<Plan> plan;
    int64_t predicted = -1;
    int64_t steps_before_plan = 0;
    bool profile_loaded = false;  // the chain came from use_profile()
    double profile_seconds = 0;   // what profile_chain took for this shape
    // Profiled in a training step of this shape (profiled_shapes() counts these).
    bool profiled() const { return chain && !profile_loaded && !borrowed; }
    // The plan is a covering shape's (PlannedOptions::borrow_plans), copied with what it was made from.
    bool borrowed = false;
    std::shared_ptr<int64_t> last_peak = std::make_shared<int64_t>(-1);
    // fit_device: the device's memory when the profiling step began, and the budget made from it (bytes).
    std::optional<memory::DeviceMemory> at_start;
    c10::Device device = c10::kCPU;
    std::shared_ptr<memory::PeakWindow> whole;  // from the profiling step's start to its planning
    int64_t lost = 0;                           // what the allocator lost to fragmentation in that step
    int64_t budget = -1;
    // Whether a planned step of this shape held more than predicted, beyond the tolerance (said, and with
    // replan_on_overshoot planned again, once), whether one held less (said once: apart, so that a step below
    // does not silence one above, as a step of another gradient state can be), and what replan_on_overshoot
    // took off its budget (bytes).
    bool overshoot_checked = false;
    bool undershoot_said = false;
    int64_t lowered = 0;
    // What an out-of-memory error in a step of the plan says of it (who, the plan, budget, prediction): made
    // with the plan, shared by its steps' words.
    std::shared_ptr<const OutOfMemory> out_of_memory;
    // Under agree: the error of planning this shape (no plan fits the budget), raised at its calls.
    std::exception_ptr plan_error;
    // The parameter gradients the plan in force charges to the stages' backward (bytes per stage: those that
    // were none, for the backward pass to make, when it was made), and the plans made for the other states
    // this shape's steps began in (gradient accumulation: none at the first micro-batch, present at the
    // others), kept to be put back in force when a step begins in that state again.
    std::vector<int64_t> grads_charged;
    struct ForGrads {
      std::vector<int64_t> grads_charged;
      Plan plan;
      int64_t predicted = -1;
      std::shared_ptr<const OutOfMemory> out_of_memory;
    };
    std::vector<ForGrads> other_plans;
  };
  // A training call's key, under which its shape's plan is kept: the sizes of the input and of each extra
  // argument (InputShape), and their form: the tensors' dtypes, then the autocast state (per device type, cpu
  // and cuda: its dtype where autocast is on, -1 where off), then the stages' modules' parameters (whether
  // each requires grad, its dtype, rank and sizes). A call that differs in either is profiled and planned on
  // its own (under autocast the same sizes save about half the bytes: a bfloat16 plan run in float32 would
  // hold far above its prediction; a stage frozen on an input that needs no gradient saves nothing: the plan
  // of two frozen stages, unfrozen, held 35% above its prediction before 2026-12-07).
  struct Key {
    InputShape sizes;
    std::vector<int64_t> form;
    bool operator<(const Key& o) const { return std::tie(sizes, form) < std::tie(o.sizes, o.form); }
  };
  struct Call;
  // The key of a training call of x and args (throws c10::Error naming remat::Planned for an undefined
  // argument), and a key in words: "[8, 32, 8] under cpu autocast to BFloat16", "[8, 32, 8] Double" (a
  // float32 tensor's dtype unsaid).
  Key key_of(const torch::Tensor& x, const std::vector<torch::Tensor>& args) const;
  static std::string describe_key(const Key& key);
  torch::Tensor profiling_step(Shape& shape, const std::vector<StageFn>& stages, const torch::Tensor& x,
                               const std::shared_ptr<Call>& call);
  void make_plan(Shape& shape);
  StepPlan chosen_plan(const Chain& chain, const StepContext& context, int64_t budget) const;
  // The bytes of the parameter gradients the stages' backward pass would make now (per stage: those of its
  // module's parameters that require a gradient and have none; a parameter shared by two stages at the one
  // the backward pass meets first).
  std::vector<int64_t> grads_to_make() const;
  // At the start of a planned step: the plan for the gradients it begins with (`grads`, grads_to_make()'s)
  // put in force, one made before or a new one (make_plan). Under agree, `lockstep` says every rank makes one
  // at this call (some rank needs a new one): a rank whose plan fits its state meets agree's collectives with
  // a plan it does not keep.
  void plan_for_grads(Shape& shape, const std::vector<int64_t>& grads, bool lockstep);
  // Under agree, at the start of a training call: the shapes the ranks' last step profiled planned (each
  // rank its own, at the same call), and every rank profiling where any rank's shape has no plan.
  void plan_in_lockstep();
  void profile_in_lockstep(Shape& shape);
  // A planned step's measured peak checked against its prediction (remat::check_prediction), at the shape's
  // next call: beyond the tolerance, warned once per shape, and with replan_on_overshoot planned again; a
  // borrowed plan's step above it warned, and the shape made new, so that this step profiles it.
  void check_measured(const Key& key, Shape& shape);
  // fit_device's reading of the device: PlannedOptions::read_device, or remat::memory::device_memory.
  memory::DeviceMemory read_device(c10::Device device) const;
  // What a planned step of `shape` says when it runs out of memory (remat::describe_out_of_memory's words).
  std::function<void(c10::Error&, const std::string&)> out_of_memory_words(
      const Shape& shape, std::shared_ptr<memory::PeakWindow> window, c10::Device device) const;
  std::vector<StageFn> bind(const std::vector<torch::Tensor>& args) const;
  bool training_now() const;
  // The training calls of forward() that may be open (a Call, planned.cpp: open from the call until a
  // backward pass reaches its output or its graph is freed), the last one the call in progress.
  std::vector<std::shared_ptr<Call>> calls_;
  bool inside_said_ = false;  // a call inside an earlier one's step was said (TORCH_WARN)
  // A new input shape's step begins: at the kProfiledShapesWarnedAt-th, the warning profiled_shapes() names.
  void new_shape(const Key& key);
  // A new input shape's step begins: with borrow_plans, the plan of the smallest planned shape that covers
  // it.
  void borrow(const Key& key);
  bool many_shapes_said_ = false;

  std::vector<ArgsStageFn> stages_;
  std::shared_ptr<HostPool> host_pool_ = std::make_shared<HostPool>();
  bool takes_args_ = false;
  PlannedOptions options_;
  std::map<Key, Shape> shapes_;
  // Profiles given to use_profile() not yet taken: the first training call of those sizes whose key is new
  // takes one.
  std::map<InputShape, Chain> given_profiles_;
  const Shape* last_ = nullptr;
};
TORCH_MODULE(Planned);

}  // namespace remat
