// The plotting script of the source tree this binary was built from: a file of its own, so that the path's
// definition reaches no other file (the others are compiled as one unit with the runtime's precompiled
// header).
namespace remat::cli {
const char* built_plot_script() {
  return REMAT_PLOT_SCRIPT;
}
const char* built_step_plot_script() {
  return REMAT_STEP_PLOT_SCRIPT;
}
}  // namespace remat::cli
