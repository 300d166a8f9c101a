// remat._core: the torch-free planner library (remat::planner) bound for Python with nanobind. Plain numbers
// and plain C++ only: nothing here touches LibTorch, so the module does not depend on torch's C++ ABI.
// Everything that touches torch (profiling, applying plans, Hugging Face) is Python beside it, in the remat
// package.
#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <remat/planner/batch.h>
#include <remat/planner/chain.h>
#include <remat/planner/device.h>
#include <remat/planner/plan.h>
#include <remat/planner/planner.h>
#include <remat/planner/report.h>
#include <remat/planner/step.h>
#include <remat/planner/strategy.h>
#include <remat/planner/timeline.h>
#include <remat/planner/units.h>

#include <memory>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// A list property of class elements (Chain.stages, Stage.groups, Stage.policies, Plan.ops). Python gets its
// elements as references into the C++ vector (so that `chain.stages[0].bwd_ms = 1` writes through, as users
// and the tests do); nanobind's def_rw setter moves the new list into the vector, which frees the elements
// those references point into, and a later read of one was a crash or garbage (`held = list(st.groups);
// st.groups = held[1:]; held[0].name`: a MemoryError, a segmentation fault in a longer script; found on
// 2026-12-05). Where Python still refers to one of the old elements, they are kept (never freed: a few per
// assignment), so that such a reference reads what it held, as any SavedGroup handed to the setter is copied
// and no longer the list's.
std::vector<std::shared_ptr<void>>& kept_elements() {
  static std::vector<std::shared_ptr<void>> kept;
  return kept;
}

// The getter def_rw makes: the member by reference (its elements handed out as references into it).
template <class C, class D>
auto member_get(D C::*p) {
  return [p](const C& c) -> const D& { return c.*p; };
}

// Moves `old`'s elements aside, kept, where Python refers to one of them (before `old` is assigned anew).
template <class T>
void keep_if_held(std::vector<T>& old) {
  for (const T& e : old) {
    if (nb::find(e).is_valid()) {
      kept_elements().push_back(std::make_shared<std::vector<T>>(std::move(old)));
      return;
    }
  }
}

template <class C, class T>
auto list_set(std::vector<T> C::*p) {
  return [p](C& c, std::vector<T> value) {
    keep_if_held(c.*p);
    c.*p = std::move(value);
  };
}

// A Plan member (StepPlan.plan): assigned in place, its ops likewise kept where held.
template <class C>
auto plan_set(remat::Plan C::*p) {
  return [p](C& c, const remat::Plan& value) {
    if (&value == &(c.*p)) return;
    keep_if_held((c.*p).ops);
    c.*p = value;
  };
}

remat::PlannerOptions planner_options(int64_t slots, bool compare_baselines, std::vector<std::string> exclude,
                                      bool offload = false, int64_t max_host_bytes = -1, bool groups = true) {
  remat::PlannerOptions o;
  o.groups = groups;
  o.slots = slots;
  o.compare_baselines = compare_baselines;
  o.exclude = std::move(exclude);
  o.offload = offload;
  o.max_host_bytes = max_host_bytes;
  return o;
}

// The Python class remat.InfeasibleBudget (a ValueError with budget_bytes and min_bytes), set at import.
PyObject* infeasible_type = nullptr;

// Runs a planner with the GIL released: planning a long chain with offloading and groups takes seconds
// (BERT-large's H200 profile: 2 to 10 s on 2 cores), in which the process's other Python threads (a
// DataLoader's pin-memory thread, a progress bar's, a heartbeat) go on. The caller copies the chain and
// context first, with the GIL held, so that another thread changing the Python objects meanwhile cannot race
// with the planner; the result is converted to Python after the GIL is taken back, and an exception thrown
// takes it back as it leaves.
template <class F>
auto without_gil(F&& f) {
  nb::gil_scoped_release release;
  return f();
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "remat's planner library (chains, plans, planners, step planning, reports), bound from C++";
  // Chains and plans held by a model's hooks (torch keeps modules alive until the interpreter's end) are
  // still alive when the interpreter shuts down; that is not a leak of the binding's.
  nb::set_leak_warnings(false);

  infeasible_type = PyErr_NewExceptionWithDoc(
      "remat._core.InfeasibleBudget",
      "No plan fits the budget. Attributes: budget_bytes (the budget asked for) and min_bytes (the least "
      "feasible one), both in bytes.",
      PyExc_ValueError, nullptr);
  m.attr("InfeasibleBudget") = nb::handle(infeasible_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const remat::InfeasibleBudget& e) {
      nb::object err = nb::steal(PyObject_CallFunction(infeasible_type, "s", e.what()));
      if (!err.is_valid()) return;  // the error set by the call stands
      err.attr("budget_bytes") = e.budget_bytes();
      err.attr("min_bytes") = e.min_bytes();
      PyErr_SetObject(infeasible_type, err.ptr());
    }
  });

  // ------------------------------------------------------------------------------------------------------------
  // Chains

  nb::class_<remat::OffloadCost>(m, "OffloadCost",
                                 "What offloading a stage run one way moves to host memory (bytes; flags).")
      .def(nb::init<>())
      .def_rw("bytes", &remat::OffloadCost::bytes,
              "what its saved tensors free on the device besides its input and output (bytes)")
      .def_rw("input", &remat::OffloadCost::input, "whether it saves its input")
      .def_rw("output", &remat::OffloadCost::output, "whether it saves its output")
      .def_rw(
          "stream_fwd_bytes", &remat::OffloadCost::stream_fwd_bytes,
          "streamed (Fa3@stream): its forward's peak above the bytes before it, each copy waited for at once "
          "(bytes; -1: not measured)")
      .def_rw("stream_bwd_bytes", &remat::OffloadCost::stream_bwd_bytes,
              "streamed: its backward's peak above the bytes before it, each tensor brought back at its use "
              "(bytes; -1: not measured)")
      .def_rw(
          "stream_bwd_grads_bytes", &remat::OffloadCost::stream_bwd_grads_bytes,
          "streamed: that backward's peak had it made the stage's parameter gradients, those made by then "
          "counted (bytes; -1: not measured, all of them charged)")
      .def_rw("stream_bwd_input_bytes", &remat::OffloadCost::stream_bwd_input_bytes,
              "streamed, sending its input: how much higher that backward's peaks are where the input comes "
              "back from the host than where it is found on the device (bytes; -1: not measured, the input's "
              "bytes charged)")
      .def("input_back_bytes", &remat::OffloadCost::input_back_bytes, "input_bytes"_a,
           "streamed: what its backward holds beyond stream_bwd_bytes where its input of `input_bytes` left "
           "the device with it (bytes)")
      .def_rw("window_bytes", &remat::OffloadCost::window_bytes,
              "streamed: the most bytes in flight each way beside those peaks (bytes)")
      .def_rw(
          "ahead_bytes", &remat::OffloadCost::ahead_bytes,
          "streamed with window_bytes: what comes back ahead of its backward, and the most in flight past "
          "its forward (bytes; -1: not measured, the window charged)")
      .def_rw("after_forward", &remat::OffloadCost::after_forward,
              "whether its copies to the host start only once its forward has run (a layer compiled on its "
              "own): hidden by the next stage's forward alone")
      .def("can_stream", &remat::OffloadCost::can_stream, "whether the stream figures were measured")
      .def(
          "tail_bytes", &remat::OffloadCost::tail_bytes, "window"_a, "leaving"_a,
          "streamed with `window` bytes, of `leaving` bytes that leave the device: what stays in flight past "
          "its forward and comes back ahead of its backward (bytes)");

  nb::class_<remat::PolicyCost>(m, "PolicyCost", "What a stage costs run as Fk under one policy (Fk[name]).")
      .def(nb::init<>())
      .def_rw("policy", &remat::PolicyCost::policy, "the policy's name")
      .def_rw("saved_bytes", &remat::PolicyCost::saved_bytes, "alive after the stage runs so (bytes)")
      .def_rw("fwd_ms", &remat::PolicyCost::fwd_ms, "its forward (milliseconds)")
      .def_rw("bwd_ms", &remat::PolicyCost::bwd_ms, "its recompute of the rest plus its backward (ms)")
      .def_rw("bwd_tmp_bytes", &remat::PolicyCost::bwd_tmp_bytes,
              "its backward's peak, recompute included, above what it keeps (bytes), or None")
      .def_rw("bwd_grads_tmp_bytes", &remat::PolicyCost::bwd_grads_tmp_bytes,
              "that peak when the backward makes the parameters' gradients (bytes), or None")
      .def_rw("offload", &remat::PolicyCost::offload, "offloading it (an OffloadCost), or None")
      .def_rw("saves_output", &remat::PolicyCost::saves_output,
              "whether what it keeps holds its output (False: gone by its backward where nothing else holds "
              "it)")
      .def_rw(
          "bwd_grad_held_bytes", &remat::PolicyCost::bwd_grad_held_bytes,
          "what holding the gradient it is handed through its backward adds (bytes), or None: the stage's");

  nb::class_<remat::SavedGroup>(m, "SavedGroup",
                                "One group of a stage's saved tensors: the outputs of one operator call.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](remat::SavedGroup* g, std::string name, int64_t bytes, double recompute_ms,
             int64_t unsaved_bytes, int64_t stays_bytes, int64_t fwd_peak_before_bytes,
             int64_t fwd_peak_after_bytes) {
            new (g) remat::SavedGroup{std::move(name),     bytes,       recompute_ms,
                                      unsaved_bytes,       stays_bytes, fwd_peak_before_bytes,
                                      fwd_peak_after_bytes};
          },
          "name"_a, "bytes"_a, "recompute_ms"_a, "unsaved_bytes"_a = 0, "stays_bytes"_a = 0,
          "fwd_peak_before_bytes"_a = -1, "fwd_peak_after_bytes"_a = -1)
      .def_rw("name", &remat::SavedGroup::name, "the call: 'aten::addmm#2' (operator, its call index)")
      .def_rw("bytes", &remat::SavedGroup::bytes, "its outputs' bytes")
      .def_rw("recompute_ms", &remat::SavedGroup::recompute_ms, "the call's forward time (milliseconds)")
      .def_rw("unsaved_bytes", &remat::SavedGroup::unsaved_bytes,
              "of its bytes, those autograd does not save in the stage's plain forward")
      .def_rw("stays_bytes", &remat::SavedGroup::stays_bytes,
              "of its bytes, those that stay on the device when it is sent (an Offload keeps them there)")
      .def_rw("fwd_peak_before_bytes", &remat::SavedGroup::fwd_peak_before_bytes,
              "the stage's plain forward's peak above what was alive before it, until this call (bytes; -1: "
              "not measured)")
      .def_rw(
          "fwd_peak_after_bytes", &remat::SavedGroup::fwd_peak_after_bytes,
          "the stage's forward without saving: its peak above what was alive before it, from when it lets go "
          "of this call's outputs until it returns (bytes; -1: not measured)")
      // pickle and copy.deepcopy (a LayerPlan's copy carries its shapes' saved calls): its seven figures
      // (five in a state pickled before 2026-12-05, six before fwd_peak_after_bytes, 2026-12-06: the later
      // ones then -1).
      .def("__getstate__",
           [](const remat::SavedGroup& g) {
             return nb::make_tuple(g.name, g.bytes, g.recompute_ms, g.unsaved_bytes, g.stays_bytes,
                                   g.fwd_peak_before_bytes, g.fwd_peak_after_bytes);
           })
      .def("__setstate__",
           [](remat::SavedGroup& g, const nb::tuple& s) {
             if (s.size() < 5 || s.size() > 7)
               throw nb::value_error("remat.SavedGroup.__setstate__: a state of 5 to 7 figures");
             new (&g) remat::SavedGroup{nb::cast<std::string>(s[0]),
                                        nb::cast<int64_t>(s[1]),
                                        nb::cast<double>(s[2]),
                                        nb::cast<int64_t>(s[3]),
                                        nb::cast<int64_t>(s[4]),
                                        s.size() >= 6 ? nb::cast<int64_t>(s[5]) : -1,
                                        s.size() >= 7 ? nb::cast<int64_t>(s[6]) : -1};
           })
      .def("__repr__", [](const remat::SavedGroup& g) {
        return "SavedGroup('" + g.name + "', bytes=" + std::to_string(g.bytes) +
               ", recompute_ms=" + std::to_string(g.recompute_ms) +
               ", unsaved_bytes=" + std::to_string(g.unsaved_bytes) +
               ", stays_bytes=" + std::to_string(g.stays_bytes) +
               (g.fwd_peak_before_bytes >= 0
                    ? ", fwd_peak_before_bytes=" + std::to_string(g.fwd_peak_before_bytes)
                    : std::string()) +
               (g.fwd_peak_after_bytes >= 0
                    ? ", fwd_peak_after_bytes=" + std::to_string(g.fwd_peak_after_bytes)
                    : std::string()) +
               ")";
      });
  m.def("group_recompute_peak_bytes", &remat::group_recompute_peak_bytes, "stage"_a, "assignment"_a,
        "The most a group assignment's recompute holds part way through, above the bytes alive before the "
        "stage's forward (-1 where no group's fwd_peak_before_bytes is measured).");
  m.def("group_forward_peak_bytes", &remat::group_forward_peak_bytes, "stage"_a, "assignment"_a,
        "A group assignment's forward's peak above the bytes alive before it (-1 where a group it keeps "
        "or sends has no fwd_peak_after_bytes measured, or none is kept or sent).");
  m.def("group_unsaved_bytes", &remat::group_unsaved_bytes, "stage"_a, "assignment"_a,
        "Of what a group assignment keeps and sends, the bytes the stage's plain forward does not save.");

  m.attr("MAX_GROUPS") = remat::kMaxGroups;
  m.attr("MAX_TAKEN_TENSORS") = remat::kMaxTakenTensors;
  m.def(
      "fit_groups", nb::overload_cast<const std::vector<remat::SavedGroup>&>(&remat::fit_groups), "found"_a,
      "The saved groups a profiler keeps of the calls found (in the forward's order): at most MAX_GROUPS, "
      "the calls costly to recompute (costly_to_recompute) first, then the others, each from the most bytes "
      "down; in the order found. Raises ValueError for negative group bytes.");
  m.def("fit_groups", nb::overload_cast<const std::vector<remat::SavedGroup>&, int64_t>(&remat::fit_groups),
        "found"_a, "room_bytes"_a,
        "The profilers' rule before 2026-12-04: the MAX_GROUPS largest, then, from the largest down, those "
        "that fit in room_bytes; in the order found. Raises ValueError for a negative room or group bytes.");
  m.def(
      "costly_to_recompute", &remat::costly_to_recompute, "call"_a,
      "Whether a call ('aten::addmm#2') is of a matrix product, a convolution or an attention kernel, which "
      "fit_groups ranks first.");
  m.def("group_cost", &remat::group_cost, "stage"_a, "assignment"_a,
        "What a stage costs under a group assignment ('khr': each group kept, sent to the host or "
        "recomputed), as a PolicyCost. Raises ValueError for an assignment that does not fit the stage.");

  nb::class_<remat::Stage>(m, "Stage", "One stage of a chain: times in milliseconds, sizes in bytes.")
      .def(nb::init<>())
      .def_rw("name", &remat::Stage::name)
      .def_rw("fwd_ms", &remat::Stage::fwd_ms, "forward time, saving for backward (milliseconds)")
      .def_rw("bwd_ms", &remat::Stage::bwd_ms, "backward time (milliseconds)")
      .def_rw("output_bytes", &remat::Stage::output_bytes, "the stage's output (bytes)")
      .def_rw("saved_bytes", &remat::Stage::saved_bytes, "alive after running it with grad: output + saved")
      .def_rw("saves_output", &remat::Stage::saves_output,
              "whether its output is among what its graph saves (false: a recompute that stops early never "
              "makes it)")
      .def_rw("saves_input", &remat::Stage::saves_input,
              "whether its graph, run as Fa, saves its input (false: a step lets go of it once its forward "
              "is done, where nothing else holds it)")
      .def_rw("bwd_output_freed_bytes", &remat::Stage::bwd_output_freed_bytes,
              "how much lower its backward's peak, run as Fa, is where its graph alone holds its output, "
              "which it lets go of once the operations that saved it have run backward (0: held through)")
      .def_rw("grads_before_recompute_bytes", &remat::Stage::grads_before_recompute_bytes,
              "checkpointed per call: what its backward holds beyond the gradient it is handed when its "
              "recompute begins (bytes; the gradients of its last operations, whose backward reads nothing "
              "saved; 0: none)")
      .def_rw("bwd_grad_held_bytes", &remat::Stage::bwd_grad_held_bytes,
              "how much higher its backward, run as Fa, peaks with the gradient it is handed held through it "
              "(as a residual sum outside the layers holds it) than with it let go of once used (bytes), or "
              "None (its output's bytes)")
      .def_rw(
          "autocast_cache_bytes", &remat::Stage::autocast_cache_bytes,
          "under autocast, what its forward kept as it is leaves in autocast's cache beside what its graph "
          "saves (bytes): charged from its forward through the rest of the step's backward")
      .def_rw("has_backward", &remat::Stage::has_backward,
              "whether it has a backward (false: its output needs no gradient, so every way runs it as Fa, "
              "and the per-layer planner keeps it)")
      .def_rw("fwd_tmp_bytes", &remat::Stage::fwd_tmp_bytes, "transient peak above that in its forward")
      .def_rw("fwd_nosave_tmp_bytes", &remat::Stage::fwd_nosave_tmp_bytes,
              "transient peak above its output in its forward without saving, as Fn and Fc run it (None: "
              "fwd_tmp_bytes)")
      .def_rw("bwd_tmp_bytes", &remat::Stage::bwd_tmp_bytes, "transient peak in its backward")
      .def_rw(
          "bwd_grads_tmp_bytes", &remat::Stage::bwd_grads_tmp_bytes,
          "that peak when the backward makes the parameters' gradients, those made by then counted (None: "
          "not measured)")
      .def_rw("fwd_nosave_ms", &remat::Stage::fwd_nosave_ms, "forward under no-grad (ms), or None")
      .def_rw("checkpoint_fwd_ms", &remat::Stage::checkpoint_fwd_ms, "forward checkpointed per call (ms)")
      .def_rw("checkpoint_bwd_ms", &remat::Stage::checkpoint_bwd_ms, "recompute + backward per call (ms)")
      .def_rw("groups_fwd_ms", &remat::Stage::groups_fwd_ms,
              "forward as a group assignment runs it, every group kept (ms), or None")
      .def_rw("groups_bwd_ms", &remat::Stage::groups_bwd_ms,
              "its backward, recompute of the calls in no group included (ms), or None")
      .def_rw("keep_saved_bytes", &remat::Stage::keep_saved_bytes)
      .def_rw("keep_fwd_ms", &remat::Stage::keep_fwd_ms)
      .def_rw("keep_bwd_ms", &remat::Stage::keep_bwd_ms)
      .def_prop_rw("policies", member_get(&remat::Stage::policies), list_set(&remat::Stage::policies),
                   "its costs under each of the chain's policies")
      .def_prop_rw("groups", member_get(&remat::Stage::groups), list_set(&remat::Stage::groups),
                   "its saved groups (SavedGroup), in its forward's order")
      .def_rw("offload", &remat::Stage::offload, "offloading it run as Fa (an OffloadCost), or None")
      .def_rw("keep_offload", &remat::Stage::keep_offload, "offloading it run as Fk, or None")
      .def_rw("checkpoint_offload", &remat::Stage::checkpoint_offload, "offloading it run as Fc, or None")
      .def("per_call_fwd_ms", &remat::Stage::per_call_fwd_ms)
      .def("per_call_bwd_ms", &remat::Stage::per_call_bwd_ms)
      .def("__repr__", [](const remat::Stage& s) {
        return "Stage('" + s.name + "', fwd_ms=" + std::to_string(s.fwd_ms) +
               ", bwd_ms=" + std::to_string(s.bwd_ms) + ", output_bytes=" + std::to_string(s.output_bytes) +
               ", saved_bytes=" + std::to_string(s.saved_bytes) + ")";
      });

  nb::class_<remat::Chain>(m, "Chain",
                           "A chain of stages as plain numbers (the C++ remat::Chain; its JSON is the remat "
                           "command's chain format, docs/chain-format.md).")
      .def(nb::init<>())
      .def_rw("input_bytes", &remat::Chain::input_bytes, "the chain's input a_0 (bytes)")
      .def_prop_rw("stages", member_get(&remat::Chain::stages), list_set(&remat::Chain::stages))
      .def_rw("keep", &remat::Chain::keep)
      .def_rw("policies", &remat::Chain::policies, "the policies the stages' PolicyCost entries are under")
      .def_rw("to_host_gb_per_s", &remat::Chain::to_host_gb_per_s,
              "copies to host memory (GB/s; 0: unmeasured)")
      .def_rw("to_device_gb_per_s", &remat::Chain::to_device_gb_per_s, "copies back (GB/s; 0: unmeasured)")
      .def_rw("holds_outputs", &remat::Chain::holds_outputs,
              "the runtime holds a kept stage's output until its backward (C++ executor's chains)")
      .def_rw("copies_at_once", &remat::Chain::copies_at_once,
              "copies to the host and back are made at once on the computing thread (a CPU device): the "
              "planner charges their time in full")
      .def("can_offload", &remat::Chain::can_offload)
      .def("size", &remat::Chain::size)
      .def("__len__", &remat::Chain::size)
      .def("activation_bytes", &remat::Chain::activation_bytes, "i"_a)
      .def_static(
          "from_json", [](const std::string& text) { return remat::chain_from_json(text); }, "text"_a,
          "Parses and validates a chain's JSON. Raises ValueError naming the problem.")
      .def("to_json", [](const remat::Chain& c) { return remat::to_json(c); })
      // pickle and copy.deepcopy (a model remat planned is copied with its plans): through the chain's JSON.
      .def("__getstate__", [](const remat::Chain& c) { return remat::to_json(c); })
      .def("__setstate__",
           [](remat::Chain& c, const std::string& text) {
             new (&c) remat::Chain(remat::chain_from_json(text));
           })
      .def(
          "validate", [](const remat::Chain& c) { remat::validate(c); },
          "Raises ValueError naming the stage.")
      .def("__repr__", [](const remat::Chain& c) {
        return "Chain(" + std::to_string(c.size()) + " stages, input_bytes=" + std::to_string(c.input_bytes) +
               ")";
      });
  m.def("load_chain", &remat::load_chain, "path"_a);
  m.def("save_chain", &remat::save_chain, "chain"_a, "path"_a);
  m.def("uniform_chain", &remat::uniform_chain, "n"_a, "fwd_ms"_a, "bwd_ms"_a, "output_bytes"_a,
        "saved_bytes"_a);

  // ------------------------------------------------------------------------------------------------------------
  // Plans

  nb::enum_<remat::OpKind>(m, "OpKind")
      .value("Fn", remat::OpKind::kForwardNoSave)
      .value("Fc", remat::OpKind::kForwardCheckpoint)
      .value("Fa", remat::OpKind::kForwardAll)
      .value("L", remat::OpKind::kLoss)
      .value("B", remat::OpKind::kBackward)
      .value("Fk", remat::OpKind::kForwardKeep);

  nb::class_<remat::Op>(m, "Op", "One operation of a plan: kind, stage (-1 for the loss), policy (Fk[name]).")
      .def(nb::init<>())
      .def_rw("kind", &remat::Op::kind)
      .def_rw("stage", &remat::Op::stage)
      .def_rw("policy", &remat::Op::policy)
      .def_rw("offload", &remat::Op::offload, "what the stage saves goes to host memory (written @host)")
      .def_rw("groups", &remat::Op::groups, "a group assignment ('khr', written Fk3{khr}), or ''")
      .def_rw("stream", &remat::Op::stream,
              "Fa only: what the stage saves streams to the host and back, each tensor just ahead of its use "
              "(written @stream)")
      .def("__eq__", [](const remat::Op& a, const remat::Op& b) { return a == b; });

  nb::class_<remat::Simulation>(m, "Simulation", "Predicted figures of a plan on a chain.")
      .def(nb::init<>())
      .def_rw("peak_bytes", &remat::Simulation::peak_bytes)
      .def_rw("time_ms", &remat::Simulation::time_ms)
      .def_rw("forward_calls", &remat::Simulation::forward_calls)
      .def_rw("peak_op", &remat::Simulation::peak_op)
      .def_rw("op_peak_bytes", &remat::Simulation::op_peak_bytes)
      .def_rw("op_done_bytes", &remat::Simulation::op_done_bytes,
              "held once each operation is done (bytes; a backward's with its input)")
      .def_rw("host_peak_bytes", &remat::Simulation::host_peak_bytes,
              "host memory of offloaded stages (bytes)")
      .def_rw("transfer_ms", &remat::Simulation::transfer_ms, "copies no computation hides (ms)");

  nb::class_<remat::Plan>(
      m, "Plan", "A schedule (the C++ remat::Plan): str(plan) is Plan::to_string(), \"Fc0 Fn1 ... B0\".")
      .def(nb::init<>())
      .def_rw("num_stages", &remat::Plan::num_stages)
      .def_prop_rw("ops", member_get(&remat::Plan::ops), list_set(&remat::Plan::ops))
      .def_rw("planner", &remat::Plan::planner)
      .def_rw("budget_bytes", &remat::Plan::budget_bytes)
      .def_rw("predicted", &remat::Plan::predicted)
      .def_rw("keep", &remat::Plan::keep)
      .def_rw("policies", &remat::Plan::policies)
      .def_rw("group_names", &remat::Plan::group_names,
              "per stage, the names of its saved groups that its Fk{...} operations assign")
      .def_rw("stream_windows", &remat::Plan::stream_windows,
              "per stage, the window a streamed run holds each way (bytes; -1 where none)")
      .def("to_string", &remat::Plan::to_string)
      .def("__str__", &remat::Plan::to_string)
      .def("__repr__", [](const remat::Plan& p) { return "Plan('" + p.to_string() + "')"; })
      .def("count", &remat::Plan::count, "kind"_a)
      .def(
          "op_text", [](const remat::Plan& p, const remat::Op& op) { return remat::op_text(p, op); }, "op"_a)
      .def("to_json", [](const remat::Plan& p) { return remat::to_json(p); })
      .def_static(
          "from_json", [](const std::string& text) { return remat::plan_from_json(text); }, "text"_a,
          "Parses and checks a plan's JSON (also what `remat plan --json` prints). Raises ValueError.")
      // pickle and copy.deepcopy: the plan's JSON, and the predicted figures it does not carry.
      .def("__getstate__",
           [](const remat::Plan& p) {
             return std::make_tuple(remat::to_json(p), p.predicted.peak_op, p.predicted.op_peak_bytes,
                                    p.predicted.host_peak_bytes, p.predicted.transfer_ms);
           })
      .def("__setstate__",
           [](remat::Plan& p,
              const std::tuple<std::string, int64_t, std::vector<int64_t>, int64_t, double>& s) {
             new (&p) remat::Plan(remat::plan_from_json(std::get<0>(s)));
             p.predicted.peak_op = std::get<1>(s);
             p.predicted.op_peak_bytes = std::get<2>(s);
             p.predicted.host_peak_bytes = std::get<3>(s);
             p.predicted.transfer_ms = std::get<4>(s);
           });
  m.def("check_plan", &remat::check_plan, "plan"_a);
  m.def(
      "offload_schedule",
      [](const remat::Plan& plan) {
        const remat::OffloadSchedule s = remat::offload_schedule(plan);
        using Points = std::vector<std::vector<std::tuple<std::string, int64_t>>>;
        auto convert = [](const std::vector<std::vector<remat::OffloadPoint>>& in) {
          Points out(in.size());
          for (size_t k = 0; k < in.size(); ++k)
            for (const remat::OffloadPoint& p : in[k])
              out[k].emplace_back(
                  p.action == remat::OffloadPoint::Action::kWaitToHost ? "wait_to_host" : "start_back",
                  p.stage);
          return out;
        };
        return std::make_pair(convert(s.before), convert(s.after));
      },
      "plan"_a,
      "The plan's offload schedule (remat::offload_schedule): (before, after), per operation of the plan the "
      "points carried out before it runs and once it has run, each (\"wait_to_host\" or \"start_back\", "
      "stage). "
      "Raises ValueError for an invalid plan.");
  m.def("simulate", &remat::simulate, "chain"_a, "plan"_a);
  m.def("checkpoint_stages", &remat::checkpoint_stages, "num_stages"_a, "stages"_a);
  m.def("per_call_time_ms", &remat::per_call_time_ms, "chain"_a, "stages"_a);
  m.def("step_plan", &remat::step_plan, "chain_plan"_a);

  // ------------------------------------------------------------------------------------------------------------
  // Planners (budgets in bytes; PlannerOptions as keyword arguments)

  m.def("no_checkpoint", &remat::no_checkpoint, "chain"_a);
  m.def("checkpoint_all", &remat::checkpoint_all, "chain"_a);
  m.def("uniform", &remat::uniform, "chain"_a, "segments"_a, "checkpoint_last_segment"_a = false);
  m.def("sqrt_n", &remat::sqrt_n, "chain"_a);
  m.def("revolve", &remat::revolve, "chain"_a, "snapshots"_a);
  m.def(
      "optimal",
      [](const remat::Chain& c, int64_t budget, int64_t slots, bool compare,
         std::vector<std::string> exclude) {
        const remat::Chain chain = c;
        return without_gil([&] {
          return remat::optimal(chain, budget, planner_options(slots, compare, std::move(exclude)));
        });
      },
      "chain"_a, "budget_bytes"_a, "slots"_a = 500, "compare_baselines"_a = true,
      "exclude"_a = std::vector<std::string>{},
      "The fastest schedule whose predicted peak fits budget_bytes (the chain's own peak, its input "
      "included). "
      "Raises InfeasibleBudget naming the least feasible budget.");
  m.def(
      "min_feasible_budget",
      [](const remat::Chain& c, std::vector<std::string> exclude) {
        const remat::Chain chain = c;
        return without_gil([&] {
          return remat::min_feasible_budget(chain, planner_options(500, true, std::move(exclude)));
        });
      },
      "chain"_a, "exclude"_a = std::vector<std::string>{});
  m.def(
      "per_layer",
      [](const remat::Chain& c, int64_t budget, std::vector<std::string> exclude, bool offload,
         int64_t max_host, bool groups) {
        const remat::Chain chain = c;
        return without_gil([&] {
          return remat::per_layer(chain, budget,
                                  planner_options(500, true, std::move(exclude), offload, max_host, groups));
        });
      },
      "chain"_a, "budget_bytes"_a, "exclude"_a = std::vector<std::string>{}, "offload"_a = false,
      "max_host_bytes"_a = -1, "groups"_a = true,
      "The fastest per-layer plan (each stage kept, kept under a policy, checkpointed on its own, or, where "
      "it "
      "has saved groups and `groups`, under a group assignment) within budget_bytes. Raises InfeasibleBudget "
      "naming the least feasible budget.");
  m.def(
      "per_layer_min_budget",
      [](const remat::Chain& c, std::vector<std::string> exclude, bool offload, int64_t max_host,
         bool groups) {
        const remat::Chain chain = c;
        return without_gil([&] {
          return remat::per_layer_min_budget(
              chain, planner_options(500, true, std::move(exclude), offload, max_host, groups));
        });
      },
      "chain"_a, "exclude"_a = std::vector<std::string>{}, "offload"_a = false, "max_host_bytes"_a = -1,
      "groups"_a = true);
  m.def(
      "make_plan",
      [](const remat::Chain& c, const std::string& strategy, int64_t budget,
         std::vector<std::string> exclude) {
        const remat::Chain chain = c;
        return without_gil([&] {
          return remat::make_plan(chain, strategy, budget, planner_options(500, true, std::move(exclude)));
        });
      },
      "chain"_a, "strategy"_a, "budget_bytes"_a = -1, "exclude"_a = std::vector<std::string>{},
      "A plan by strategy word, in the grammar of the C++ library and the remat command (\"none\", \"all\", "
      "\"uniform:4\", \"optimal:300MiB\", \"per-layer\", ...).");
  m.attr("STRATEGY_WORDS") = remat::kStrategyWords;

  // ------------------------------------------------------------------------------------------------------------
  // The whole step

  nb::class_<remat::StepContext>(
      m, "StepContext", "What surrounds a chain in a training step (bytes above the step's base; ms).")
      .def(nb::init<>())
      .def_rw("input_in_base", &remat::StepContext::input_in_base)
      .def_rw("before_saved_bytes", &remat::StepContext::before_saved_bytes)
      .def_rw("before_peak_bytes", &remat::StepContext::before_peak_bytes)
      .def_rw("before_backward_peak_bytes", &remat::StepContext::before_backward_peak_bytes)
      .def_rw("rest_peak_bytes", &remat::StepContext::rest_peak_bytes)
      .def_rw("rest_ms", &remat::StepContext::rest_ms)
      .def_rw("rest_grads_bytes", &remat::StepContext::rest_grads_bytes)
      .def_rw("stage_grads_bytes", &remat::StepContext::stage_grads_bytes)
      .def_rw("checkpoint_all_peak_bytes", &remat::StepContext::checkpoint_all_peak_bytes)
      .def_rw("side_bytes", &remat::StepContext::side_bytes)
      .def_rw("side_grads_bytes", &remat::StepContext::side_grads_bytes,
              "per stage, of side_bytes the gradients that arrive at its backward (bytes)")
      .def_rw("side_freed_bytes", &remat::StepContext::side_freed_bytes,
              "per stage, of side_bytes what is let go of once its backward is done (bytes)")
      .def_rw("side_grads_late_bytes", &remat::StepContext::side_grads_late_bytes,
              "per stage, of side_grads_bytes what arrives after its backward's peak (bytes)")
      .def_rw("input_held_in_backward", &remat::StepContext::input_held_in_backward)
      .def_rw("outputs_held_in_backward", &remat::StepContext::outputs_held_in_backward,
              "per stage, whether anything besides the stages holds its input once its backward is done")
      .def_rw("inputs_held_in_forward", &remat::StepContext::inputs_held_in_forward,
              "per stage, whether anything besides the stages held its input past its forward")
      .def_rw(
          "output_held_in_backward", &remat::StepContext::output_held_in_backward,
          "whether anything besides the rest of the step and the last stage holds the chain's output once "
          "the rest's backward is done")
      .def_rw("outputs_held_to_end", &remat::StepContext::outputs_held_to_end,
              "per stage, whether anything besides the stages holds its output to the step's end")
      .def_rw(
          "checkpoint_state_bytes", &remat::StepContext::checkpoint_state_bytes,
          "what a stage run by a way that recomputes holds beside its input until its backward is done: the "
          "random generators' states its checkpoint saved (bytes; 0 on CUDA)")
      .def_rw(
          "between_forward_held_bytes", &remat::StepContext::between_forward_held_bytes,
          "per stage, what the forward of what runs between the stage before it and it leaves held (bytes)")
      .def_rw("between_backward_peak_bytes", &remat::StepContext::between_backward_peak_bytes,
              "per stage, the backward peak of what runs between the stage before it and it (bytes)")
      .def_rw(
          "between_held_bytes", &remat::StepContext::between_held_bytes,
          "per stage, what the backward of what runs between the stage before it and it leaves held beyond "
          "the model (bytes; negative where it frees more)")
      .def_rw("between_frees_output", &remat::StepContext::between_frees_output,
              "per stage, whether what runs between the stage before it and it let go of that stage's output")
      .def_rw("rest_frees_output", &remat::StepContext::rest_frees_output,
              "whether the rest of the step let go of the chain's output in its forward")
      .def_rw("rest_takes_last_input", &remat::StepContext::rest_takes_last_input,
              "whether the rest of the step also takes the last stage's input (a residual sum over it)")
      .def_rw("output_grad_held_in_backward", &remat::StepContext::output_grad_held_in_backward,
              "per stage, whether the chain's output gradient is alive still once its backward is done")
      .def_rw("last_input_let_go_in_rest", &remat::StepContext::last_input_let_go_in_rest,
              "whether the last stage's input, held past its forward, was let go of in the rest's forward")
      .def_rw("residual_grad_shared", &remat::StepContext::residual_grad_shared,
              "per stage, whether what takes its output after it hands it its own path's gradient tensor")
      .def_rw("taken_bytes", &remat::StepContext::taken_bytes,
              "tensors made before the chain that only the stages that take them hold past the forward "
              "(masks): each one's bytes, of before_saved_bytes")
      .def_rw("taken_by", &remat::StepContext::taken_by,
              "per tensor of taken_bytes, per stage, whether the stage takes it")
      .def_rw("taken_saved_by", &remat::StepContext::taken_saved_by,
              "per tensor of taken_bytes, per stage, whether the stage's plain forward's graph saves it")
      // pickle and copy.deepcopy: its fields (states of 11 fields, from before the between figures, of 16,
      // from before output_held_in_backward, checkpoint_state_bytes and outputs_held_to_end, of 19, from
      // before side_freed_bytes, of 20, from before between_frees_output, and of 21, from before
      // rest_frees_output, of 22, from before inputs_held_in_forward, and of 23, from before
      // output_grad_held_in_backward, of 24, from before rest_takes_last_input, of 25, from before
      // last_input_let_go_in_rest, of 26, from before residual_grad_shared, of 27, from before the taken
      // tensors, and of 30, from before side_grads_late_bytes, too).
      .def("__getstate__",
           [](const remat::StepContext& c) {
             return nb::make_tuple(
                 c.input_in_base, c.before_saved_bytes, c.before_peak_bytes, c.before_backward_peak_bytes,
                 c.rest_peak_bytes, c.rest_ms, c.rest_grads_bytes, c.stage_grads_bytes,
                 c.checkpoint_all_peak_bytes, c.side_bytes, c.input_held_in_backward,
                 c.between_forward_held_bytes, c.between_backward_peak_bytes, c.between_held_bytes,
                 c.side_grads_bytes, c.outputs_held_in_backward, c.output_held_in_backward,
                 c.checkpoint_state_bytes, c.outputs_held_to_end, c.side_freed_bytes, c.between_frees_output,
                 c.rest_frees_output, c.inputs_held_in_forward, c.output_grad_held_in_backward,
                 c.rest_takes_last_input, c.last_input_let_go_in_rest, c.residual_grad_shared, c.taken_bytes,
                 c.taken_by, c.taken_saved_by, c.side_grads_late_bytes);
           })
      .def("__setstate__", [](remat::StepContext& c, const nb::tuple& s) {
        if (s.size() != 11 && s.size() != 16 && s.size() != 19 && s.size() != 20 && s.size() != 21 &&
            s.size() != 22 && s.size() != 23 && s.size() != 24 && s.size() != 25 && s.size() != 26 &&
            s.size() != 27 && s.size() != 30 && s.size() != 31)
          throw nb::value_error(
              "remat.StepContext: a pickled state has 11, 16, 19, 20, 21, 22, 23, 24, 25, 26, 27, 30 or 31 "
              "fields");
        new (&c) remat::StepContext();
        c.input_in_base = nb::cast<bool>(s[0]);
        c.before_saved_bytes = nb::cast<int64_t>(s[1]);
        c.before_peak_bytes = nb::cast<int64_t>(s[2]);
        c.before_backward_peak_bytes = nb::cast<int64_t>(s[3]);
        c.rest_peak_bytes = nb::cast<int64_t>(s[4]);
        c.rest_ms = nb::cast<double>(s[5]);
        c.rest_grads_bytes = nb::cast<int64_t>(s[6]);
        c.stage_grads_bytes = nb::cast<std::vector<int64_t>>(s[7]);
        c.checkpoint_all_peak_bytes = nb::cast<int64_t>(s[8]);
        c.side_bytes = nb::cast<int64_t>(s[9]);
        c.input_held_in_backward = nb::cast<bool>(s[10]);
        if (s.size() >= 16) {
          c.between_forward_held_bytes = nb::cast<std::vector<int64_t>>(s[11]);
          c.between_backward_peak_bytes = nb::cast<std::vector<int64_t>>(s[12]);
          c.between_held_bytes = nb::cast<std::vector<int64_t>>(s[13]);
          c.side_grads_bytes = nb::cast<std::vector<int64_t>>(s[14]);
          c.outputs_held_in_backward = nb::cast<std::vector<bool>>(s[15]);
        }
        if (s.size() >= 19) {
          c.output_held_in_backward = nb::cast<bool>(s[16]);
          c.checkpoint_state_bytes = nb::cast<int64_t>(s[17]);
          c.outputs_held_to_end = nb::cast<std::vector<bool>>(s[18]);
        }
        if (s.size() >= 20) c.side_freed_bytes = nb::cast<std::vector<int64_t>>(s[19]);
        if (s.size() >= 21) c.between_frees_output = nb::cast<std::vector<bool>>(s[20]);
        if (s.size() >= 22) c.rest_frees_output = nb::cast<bool>(s[21]);
        if (s.size() >= 23) c.inputs_held_in_forward = nb::cast<std::vector<bool>>(s[22]);
        if (s.size() >= 24) c.output_grad_held_in_backward = nb::cast<std::vector<bool>>(s[23]);
        if (s.size() >= 25) c.rest_takes_last_input = nb::cast<bool>(s[24]);
        if (s.size() >= 26) c.last_input_let_go_in_rest = nb::cast<bool>(s[25]);
        if (s.size() >= 27) c.residual_grad_shared = nb::cast<std::vector<bool>>(s[26]);
        if (s.size() >= 30) {
          c.taken_bytes = nb::cast<std::vector<int64_t>>(s[27]);
          c.taken_by = nb::cast<std::vector<std::vector<bool>>>(s[28]);
          c.taken_saved_by = nb::cast<std::vector<std::vector<bool>>>(s[29]);
        }
        if (s.size() >= 31) c.side_grads_late_bytes = nb::cast<std::vector<int64_t>>(s[30]);
      });
  nb::class_<remat::StepReadings>(
      m, "StepReadings",
      "A meter's readings at named points of a profiling step (counts of bytes, any "
      "origin; ms); step_context() turns them into a StepContext, as in C++.")
      .def(nb::init<>())
      .def_rw("base", &remat::StepReadings::base)
      .def_rw("input_in_base", &remat::StepReadings::input_in_base)
      .def_rw("at_chain", &remat::StepReadings::at_chain)
      .def_rw("peak_before_chain", &remat::StepReadings::peak_before_chain)
      .def_rw("input_bytes", &remat::StepReadings::input_bytes)
      .def_rw("at_return", &remat::StepReadings::at_return)
      .def_rw("rest_peak", &remat::StepReadings::rest_peak)
      .def_rw("at_output_grad", &remat::StepReadings::at_output_grad)
      .def_rw("output_grad_bytes", &remat::StepReadings::output_grad_bytes)
      .def_rw("output_grad_storage_bytes", &remat::StepReadings::output_grad_storage_bytes)
      .def_rw("output_freed_bytes", &remat::StepReadings::output_freed_bytes)
      .def_rw("checkpoint_state_bytes", &remat::StepReadings::checkpoint_state_bytes)
      .def_rw("outputs_held_to_end", &remat::StepReadings::outputs_held_to_end)
      .def_rw("rest_ms", &remat::StepReadings::rest_ms)
      .def_rw("peak_after_chain_backward", &remat::StepReadings::peak_after_chain_backward)
      .def_rw("step_peak", &remat::StepReadings::step_peak)
      .def_rw("stage_grads_bytes", &remat::StepReadings::stage_grads_bytes)
      .def_rw("side_bytes", &remat::StepReadings::side_bytes)
      .def_rw("side_grads_bytes", &remat::StepReadings::side_grads_bytes)
      .def_rw("side_grads_late_bytes", &remat::StepReadings::side_grads_late_bytes)
      .def_rw("side_freed_bytes", &remat::StepReadings::side_freed_bytes)
      .def_rw("input_held_in_backward", &remat::StepReadings::input_held_in_backward)
      .def_rw("input_freed_in_rest", &remat::StepReadings::input_freed_in_rest)
      .def_rw("outputs_held_in_backward", &remat::StepReadings::outputs_held_in_backward)
      .def_rw("inputs_held_in_forward", &remat::StepReadings::inputs_held_in_forward)
      .def_rw("between_forward_held_bytes", &remat::StepReadings::between_forward_held_bytes)
      .def_rw("between_backward_peak_bytes", &remat::StepReadings::between_backward_peak_bytes)
      .def_rw("between_held_bytes", &remat::StepReadings::between_held_bytes)
      .def_rw("between_frees_output", &remat::StepReadings::between_frees_output)
      .def_rw("rest_frees_output", &remat::StepReadings::rest_frees_output)
      .def_rw("rest_takes_last_input", &remat::StepReadings::rest_takes_last_input)
      .def_rw("output_grad_held_in_backward", &remat::StepReadings::output_grad_held_in_backward)
      .def_rw("last_input_let_go_in_rest", &remat::StepReadings::last_input_let_go_in_rest)
      .def_rw("residual_grad_shared", &remat::StepReadings::residual_grad_shared);
  m.def("step_context", &remat::step_context, "readings"_a);
  m.def(
      "context_for_grads",
      [](const remat::StepContext& context, const std::vector<int64_t>& stage_grads_bytes, int64_t rest_bytes,
         int64_t between_bytes, int64_t before_bytes) {
        return remat::context_for_grads(context, stage_grads_bytes,
                                        remat::GradsOutside{rest_bytes, between_bytes, before_bytes});
      },
      "context"_a, "stage_grads_bytes"_a, "rest_bytes"_a = 0, "between_bytes"_a = 0, "before_bytes"_a = 0,
      "The context of a step that begins in another state of the parameter gradients: the stages' gradients "
      "it makes, and those of parameters outside them it makes beyond the measured step's (negative: fewer), "
      "by where the backward makes them (remat/planner/step.h, GradsOutside).");
  m.def(
      "plan_figures",
      [](const remat::Chain& chain, const remat::StepContext& context) {
        remat::PlanFigures f = remat::plan_figures(chain, context);
        return std::make_tuple(std::move(f.ints), std::move(f.reals));
      },
      "chain"_a, "context"_a,
      "Every figure a plan depends on, (ints, reals), encoded so that the elementwise maximum over processes "
      "is the one they agree on (remat::plan_figures).");
  m.def(
      "set_plan_figures",
      [](remat::Chain& chain, remat::StepContext& context, std::vector<int64_t> ints,
         std::vector<double> reals) {
        remat::set_plan_figures(chain, context, remat::PlanFigures{std::move(ints), std::move(reals)});
      },
      "chain"_a, "context"_a, "ints"_a, "reals"_a,
      "Writes figures reduced by a maximum back (remat::set_plan_figures); ValueError when they do not fit.");
  nb::class_<remat::StepPlan>(m, "StepPlan", "A plan for a whole step and its predicted peak.")
      .def_prop_rw("plan", member_get(&remat::StepPlan::plan), plan_set(&remat::StepPlan::plan))
      .def_rw("step_peak_bytes", &remat::StepPlan::step_peak_bytes)
      .def_rw("step_time_ms", &remat::StepPlan::step_time_ms);
  m.def("step_peak_bytes", &remat::step_peak_bytes, "chain"_a, "context"_a, "plan"_a);
  m.def("step_time_ms", &remat::step_time_ms, "chain"_a, "context"_a, "plan"_a,
        "A per-layer plan's step time (ms) as plan_step(..., 'per-layer') charges it (remat::step_time_ms); "
        "ValueError for another plan or a way the chain has no figures for.");
  m.def(
      "plan_step",
      [](const remat::Chain& c, const remat::StepContext& ctx, int64_t budget, const std::string& planner,
         std::vector<std::string> exclude, bool offload, int64_t max_host) {
        const remat::Chain chain = c;
        const remat::StepContext context = ctx;
        return without_gil([&] {
          return remat::plan_step(chain, context, budget, planner,
                                  planner_options(500, true, std::move(exclude), offload, max_host));
        });
      },
      "chain"_a, "context"_a, "budget_bytes"_a, "planner"_a = "optimal",
      "exclude"_a = std::vector<std::string>{}, "offload"_a = false, "max_host_bytes"_a = -1);
  m.def(
      "min_step_budget",
      [](const remat::Chain& c, const remat::StepContext& ctx, const std::string& planner,
         std::vector<std::string> exclude, bool offload, int64_t max_host) {
        const remat::Chain chain = c;
        const remat::StepContext context = ctx;
        return without_gil([&] {
          return remat::min_step_budget(chain, context, planner,
                                        planner_options(500, true, std::move(exclude), offload, max_host));
        });
      },
      "chain"_a, "context"_a, "planner"_a = "optimal", "exclude"_a = std::vector<std::string>{},
      "offload"_a = false, "max_host_bytes"_a = -1);

  // ------------------------------------------------------------------------------------------------------------
  // Reports and units

  nb::class_<remat::MemoryBreakdown>(m, "MemoryBreakdown",
                                     "A training step's memory and what checkpointing can save.")
      .def_rw("parameters", &remat::MemoryBreakdown::parameters)
      .def_rw("gradients", &remat::MemoryBreakdown::gradients)
      .def_rw("optimizer", &remat::MemoryBreakdown::optimizer)
      .def_rw("inputs", &remat::MemoryBreakdown::inputs)
      .def_rw("activations", &remat::MemoryBreakdown::activations)
      .def_rw("least_activations", &remat::MemoryBreakdown::least_activations)
      .def_rw("per_layer_activations", &remat::MemoryBreakdown::per_layer_activations)
      .def_rw("optimizer_name", &remat::MemoryBreakdown::optimizer_name)
      .def("total", &remat::MemoryBreakdown::total)
      .def("saving", &remat::MemoryBreakdown::saving)
      .def("weights", &remat::MemoryBreakdown::weights)
      .def("weights_dominate", &remat::MemoryBreakdown::weights_dominate)
      .def("percent", &remat::MemoryBreakdown::percent, "bytes"_a)
      .def("verdict", &remat::MemoryBreakdown::verdict);
  m.def(
      "memory_breakdown",
      [](const remat::Chain& c, int64_t params, int64_t trainable, const std::string& optimizer) {
        return remat::memory_breakdown(c, params, trainable, remat::parse_optimizer(optimizer));
      },
      "chain"_a, "parameter_bytes"_a, "trainable_bytes"_a, "optimizer"_a = "adam");
  m.def(
      "summarize_plan_json",
      [](const remat::Chain& c, const remat::Plan& p) { return remat::to_json(remat::summarize_plan(c, p)); },
      "chain"_a, "plan"_a, "What `remat plan --json` prints for this plan on this chain.");
  m.def("format_bytes", &remat::format_bytes, "bytes"_a);
  m.def("parse_size", &remat::parse_size, "text"_a);
  m.def(
      "check_exclude",
      [](const std::vector<std::string>& exclude, const std::string& who) {
        remat::check_exclude(exclude, who.c_str());
      },
      "exclude"_a, "who"_a,
      "Checks a planner's exclude texts (\"Fk\", \"Fk[tags]\", \"Fk[NAME]\"): ValueError naming `who` and "
      "the first that is none of these (remat/planner/planner.h).");

  nb::class_<remat::DeviceRoom>(
      m, "DeviceRoom",
      "What a device has for a training step (bytes): free, held by the caching "
      "allocator beyond its tensors, its capacity, and what the profiling step lost "
      "to fragmentation (remat/planner/device.h).")
      .def(nb::init<>())
      .def_rw("free_bytes", &remat::DeviceRoom::free_bytes)
      .def_rw("cached_bytes", &remat::DeviceRoom::cached_bytes)
      .def_rw("total_bytes", &remat::DeviceRoom::total_bytes)
      .def_rw("lost_bytes", &remat::DeviceRoom::lost_bytes);
  m.def("device_budget", &remat::device_budget, "room"_a, "fraction"_a);
  m.def("device_margin", &remat::device_margin, "total_bytes"_a);
  m.def("bandwidth_probe_bytes", &remat::bandwidth_probe_bytes, "largest_bytes"_a, "cpu_device"_a,
        "The bytes a profiler copies to measure a device's link to the host (both profilers' rule).");
  m.def("lost_to_fragmentation", &remat::lost_to_fragmentation, "reserved_then"_a, "allocated_then"_a,
        "peak_over_then"_a, "reserved_now"_a);
  m.def("describe_room", &remat::describe_room, "room"_a);
  m.def("parse_device_fraction", &remat::parse_device_fraction, "text"_a);

  m.def(
      "chain_at_batch", &remat::chain_at_batch, "a"_a, "batch_a"_a, "b"_a, "batch_b"_a, "batch"_a,
      "The chain at `batch` on the line through profiles at two batches (remat/planner/batch.h); ValueError "
      "when they are not of one chain.");
  m.def("context_at_batch", &remat::context_at_batch, "a"_a, "batch_a"_a, "b"_a, "batch_b"_a, "batch"_a,
        "The step context at `batch`, as chain_at_batch carries the chain.");
  m.def("largest_batch", &remat::largest_batch, "fits"_a, "limit"_a,
        "The largest batch in [1, limit] that fits(batch) accepts, for a fits that accepts every batch below "
        "one it accepts (0 when fits(1) is false).");
  nb::class_<remat::OutOfMemory>(
      m, "OutOfMemory",
      "What a runtime knew when a step it planned ran out of memory (bytes; -1: not "
      "known; remat/planner/device.h).")
      .def(nb::init<>())
      .def_rw("who", &remat::OutOfMemory::who)
      .def_rw("where", &remat::OutOfMemory::where)
      .def_rw("plan", &remat::OutOfMemory::plan)
      .def_rw("budget_bytes", &remat::OutOfMemory::budget_bytes)
      .def_rw("budget_words", &remat::OutOfMemory::budget_words)
      .def_rw("predicted_peak_bytes", &remat::OutOfMemory::predicted_peak_bytes)
      .def_rw("held_bytes", &remat::OutOfMemory::held_bytes)
      .def_rw("request_bytes", &remat::OutOfMemory::request_bytes)
      .def_rw("free_bytes", &remat::OutOfMemory::free_bytes)
      .def_rw("reserved_bytes", &remat::OutOfMemory::reserved_bytes)
      .def_rw("allocated_bytes", &remat::OutOfMemory::allocated_bytes);
  m.def("budget_that_would_fit", &remat::budget_that_would_fit, "oom"_a);
  nb::class_<remat::PredictionCheck>(m, "PredictionCheck")
      .def_ro("error", &remat::PredictionCheck::error, "(measured - predicted) / predicted")
      .def_ro("beyond", &remat::PredictionCheck::beyond, "|error| > the tolerance")
      .def_ro("replan_budget_bytes", &remat::PredictionCheck::replan_budget_bytes,
              "the budget to plan again for, or -1");
  m.attr("PREDICTION_TOLERANCE") = remat::kPredictionTolerance;
  m.attr("PROFILED_SHAPES_WARNED_AT") = remat::kProfiledShapesWarnedAt;
  m.def("covering_shape", &remat::covering_shape, "planned"_a, "shape"_a,
        "Among the planned input shapes (each a list of tensor sizes), the index of the one whose plan a new "
        "shape borrows (it covers it, with the fewest elements), or -1 (remat/planner/step.h).");
  m.def("check_prediction", &remat::check_prediction, "predicted_bytes"_a, "measured_bytes"_a,
        "budget_bytes"_a, "tolerance"_a = remat::kPredictionTolerance);
  m.def("describe_out_of_memory", &remat::describe_out_of_memory, "oom"_a, "last"_a = "");
  m.def(
      "step_timeline_json",
      [](const remat::Chain& chain, const remat::StepContext& context, const remat::Plan& plan,
         int64_t budget_bytes) {
        return remat::step_timeline_json(remat::step_timeline(chain, context, plan), budget_bytes);
      },
      "chain"_a, "context"_a, "plan"_a, "budget_bytes"_a = -1,
      "The planned step's predicted course, operation by operation, as JSON (remat/planner/timeline.h).");
}
