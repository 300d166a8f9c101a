// remat::Offload (remat/offload.h): saved-tensor hooks that send what autograd saves to a host pool and bring
// it back for the backward pass, on a side stream where the device has streams (CUDA), at once on the CPU, or
// late on purpose (OffloadOptions::copy_delay, for tests).

#include "remat/offload.h"

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <functional>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "autograd/engine.h"
#include "autograd/hooks.h"
#include "autograd/saved.h"
#include "autograd/watch.h"
#include "offload/offload.h"

namespace remat {
namespace {

constexpr int64_t kAlign = 512;

int64_t rounded(int64_t nbytes) {
  return std::max(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
}

}  // namespace

// ------------------------------------------------------------------------------------------------------------
// HostPool

HostPool::HostPool(int64_t max_bytes, std::optional<bool> pin)
    : max_bytes_(max_bytes), pin_(pin.value_or(at::hasCUDA())) {
  TORCH_CHECK(max_bytes >= -1, "remat::HostPool: max_bytes must be >= 0, or -1 for no bound, got ",
              max_bytes);
}

HostPool::~HostPool() = default;

at::Tensor HostPool::allocate(int64_t size) {
  if (max_bytes_ >= 0 && reserved_ + size > max_bytes_) return {};
  at::Tensor block;
  if (pin_) {
    block = at::empty({size}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  } else {
    // Memory of the C library's, not torch's CPU allocator: remat's CPU meter (which wraps that allocator)
    // counts the device's tensors and this pool counts the host's, apart.
    void* p = std::malloc(static_cast<size_t>(size));
    TORCH_CHECK(p != nullptr, "remat::HostPool: cannot allocate ", size, " bytes of host memory");
    block = at::from_blob(
        p, {size}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
  }
  reserved_ += size;
  return block;
}

at::Tensor HostPool::take(int64_t nbytes) {
  const int64_t size = rounded(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  at::Tensor block;
  auto it = free_.find(size);
  if (it != free_.end() && !it->second.empty()) {
    block = std::move(it->second.back());
    it->second.pop_back();
  } else {
    block = allocate(size);
    if (!block.defined()) return block;
  }
  in_use_ += size;
  peak_ = std::max(peak_, in_use_);
  return block;
}

void HostPool::give(const at::Tensor& block) {
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ -= block.numel();
  free_[block.numel()].push_back(block);
}

void HostPool::reserve(int64_t nbytes, int64_t block_bytes) {
  TORCH_CHECK(nbytes >= 0 && block_bytes > 0, "remat::HostPool::reserve: nbytes (", nbytes,
              ") must be >= 0 and block_bytes (", block_bytes, ") > 0");
  const int64_t size = rounded(block_bytes);
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t k = 0; k < (nbytes + size - 1) / size; ++k) {
    at::Tensor block = allocate(size);
    TORCH_CHECK(block.defined(), "remat::HostPool::reserve: ", nbytes, " bytes exceed max_bytes (",
                max_bytes_, ")");
    free_[size].push_back(std::move(block));
  }
}

void HostPool::release() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, blocks] : free_)
    reserved_ -= size * static_cast<int64_t>(blocks.size());
  free_.clear();
}

int64_t HostPool::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}
int64_t HostPool::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}
int64_t HostPool::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}
void HostPool::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = in_use_;
}

// ------------------------------------------------------------------------------------------------------------
// The hooks

namespace detail {

bool sendable(const at::Tensor& t, int64_t min_bytes) {
  if (!t.defined() || t.layout() != at::kStrided || !t.has_storage() || t.is_meta()) return false;
  if (t.is_leaf() && t.requires_grad()) return false;  // a parameter, or an input that requires grad
  // A conjugate or negative view's bytes are not its values: it stays, with its bit, as autograd keeps it.
  if (t.is_conj() || t.is_neg()) return false;
  // Dense: its elements fill one byte range (contiguous, or a permutation of it such as a transposed query or
  // attention output): that range goes, and comes back as the same view.
  return static_cast<int64_t>(t.nbytes()) >= min_bytes && t.is_non_overlapping_and_dense();
}

// The alignment a copy brought back keeps of its saved tensor's address (bytes), by device: a kernel that
// chooses or computes by alignment then runs on it as on the tensor saved. On CUDA, PyTorch hands cuBLASLt
// each operand's alignment, the largest power of two up to 256 that divides its address, and cuBLASLt picks
// its algorithm by it; on the CPU, MKL's arithmetic outside its reproducible mode may depend on 64-byte
// alignment (the Python package's remat.offload keeps the same).
int64_t alignment_of(c10::Device device) {
  return device.is_cuda() ? 256 : 64;
}

// nbytes of new device memory (uint8) starting at `align` modulo alignment_of(device). Where that takes more
// than nbytes, at most `align` more (the allocator's blocks are aligned): bytes the storage saved held before
// the tensor; a whole alignment more where a block is not.
at::Tensor aligned_as(int64_t align, int64_t nbytes, c10::Device device) {
  const auto options = at::TensorOptions().dtype(at::kByte).device(device);
  if (align == 0) return at::empty({nbytes}, options);
  const int64_t unit = alignment_of(device);
  at::Tensor buf = at::empty({nbytes + align}, options);
  if (reinterpret_cast<uintptr_t>(buf.data_ptr()) % static_cast<uintptr_t>(unit) != 0) {
    buf = at::Tensor();  // a block not aligned itself: room for any start
    buf = at::empty({nbytes + unit}, options);
  }
  const auto at =
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(buf.data_ptr()) % static_cast<uintptr_t>(unit));
  return buf.narrow(0, ((align - at) % unit + unit) % unit, nbytes);
}

// A copy in flight: query() whether it has completed, wait() for it (on a device with streams, the current
// stream waits too, so that its next work reads the copy).
struct Copy {
  std::function<bool()> query;
  std::function<void()> wait;
};

class OffloadState final : public HookSource, public std::enable_shared_from_this<OffloadState> {
 public:
  explicit OffloadState(OffloadOptions options) : options_(std::move(options)) {
    if (!options_.pool()) options_.pool(std::make_shared<HostPool>());
    for (const at::Tensor& t : options_.keep_on_device()) {
      if (t.defined() && t.has_storage()) never_sent_.push_back(t.storage().data());
    }
  }

  // One offloaded byte range of a storage (the bytes a saved tensor covers). Saved tensors of one storage
  // that cover the same bytes (the views of one input that several operators save, each its own view) share
  // it.
  struct Entry {
    std::shared_ptr<HostPool> pool;
    at::Tensor block, host;  // the host block, and its first nbytes (uint8)
    at::Tensor source;       // the device bytes (uint8), held until their copy to the host has completed
    at::Tensor device_copy;  // the bytes on the device (uint8), brought back or found there
    std::shared_ptr<Copy> to_host, to_device;
    // The device storage and the saved tensor's version counter: still alive at the backward pass (another
    // holder kept it on the device) and not written since, it is handed out itself, nothing brought back.
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
    c10::VariableVersion counter;
    int64_t offset = 0;  // bytes into the storage
    int64_t align = 0;   // the saved tensor's address modulo alignment_of(device), which a copy back keeps
    int64_t nbytes = 0;
    bool aliased = false;  // device_copy is that storage
    // Another saved tensor keeps the storage on the device (a view of it with gaps): its host copy is not
    // needed, and the entry holds the storage, as autograd would hold the tensor saved, until it is dropped.
    c10::Storage held_storage;
    int64_t version = 0;
    bool unpacked = false;
    bool copied_at_once = false;  // its host copy made at once (the CPU): to_host only holds the source
    at::Device device = at::kCPU;
    ~Entry() {
      // Both copies done before the block is reused (errors are not raised here: autograd is dropping it).
      try {
        if (to_device) to_device->wait();
        if (to_host) to_host->wait();
      } catch (...) {
      }
      device_copy = source = host = at::Tensor();
      if (block.defined()) pool->give(block);
    }
  };

  std::unique_ptr<torch::autograd::SavedVariableHooks> make_hooks() override {
    return std::make_unique<Hooks>(shared_from_this());
  }
  // A checkpoint region inside sends what it keeps here too (what remat::keep calls and a policy keep).
  HookSource* kept_sink() override { return this; }

  // Null: t stays as autograd keeps it (not offloadable, or of a storage another saved tensor keeps on the
  // device: copying it would free nothing).
  // `shift`: set to t's first element's distance (in elements) from the returned entry's start.
  std::shared_ptr<Entry> pack(const at::Tensor& t, int64_t* shift) {
    *shift = 0;
    WatchPause pause;  // the hooks' own tensor work is not the region's
    c10::AutoGradMode no_grad(false);
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (!offloadable(t) || left_here(t)) {
      save_as_itself(t);
      return nullptr;
    }
    const int64_t nbytes = static_cast<int64_t>(t.nbytes());
    const int64_t offset = t.storage_offset() * static_cast<int64_t>(t.itemsize());
    const Key key{t.storage().data(), offset, nbytes, t._version()};
    auto known = by_storage_.find(key);
    if (known != by_storage_.end()) {
      std::shared_ptr<Entry> e = known->second.lock();
      // The same storage (alive, so no other one is at its address): those bytes went already.
      if (e && e->storage.lock().get() == t.storage().unsafeGetStorageImpl()) return e;
    }
    if (std::shared_ptr<Entry> e = covering(t, offset, shift)) return e;
    at::Tensor block = options_.pool()->take(nbytes);
    if (!block.defined()) {
      ++stats_.kept_on_device;
      save_as_itself(t);
      return nullptr;
    }
    auto e = std::make_shared<Entry>();
    e->pool = options_.pool();
    e->block = block;
    e->nbytes = nbytes;
    e->device = t.device();
    e->host = block.narrow(0, 0, nbytes);
    // Its byte range in storage order (dense: contiguous, or a permutation of it), a view: a later in-place
    // write shows in its version.
    e->source = t.detach().as_strided({t.numel()}, {1}).view(at::kByte);
    e->storage = t.storage().getWeakStorageImpl();
    e->counter = t.unsafeGetTensorImpl()->version_counter();
    e->offset = offset;
    e->align = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) %
                                    static_cast<uintptr_t>(alignment_of(t.device())));
    e->version = t._version();
    e->to_host = copy(e->host, e->source);
    if (!e->to_host && options_.hold_until_waited()) {
      // Copied already (the CPU, at once): its source held all the same until the copy is waited for, as a
      // GPU holds it while a copy that outlasts the work beside it is in flight (OffloadOptions).
      e->to_host = std::make_shared<Copy>(Copy{[] { return false; }, [] {}});
      e->copied_at_once = true;
    }
    if (!e->to_host) {
      e->source = at::Tensor();  // copied already
    } else {
      in_flight_.push_back(e);
    }
    if (order_.size() >= 2 * prune_at_) prune();
    by_storage_[key] = e;
    at_[key_of(t)].push_back(e);
    order_.push_back(e);
    ++stats_.offloaded;
    stats_.offloaded_bytes += nbytes;
    stats_.largest_bytes = std::max(stats_.largest_bytes, nbytes);
    if (options_.window() >= 0) bound_in_flight();
    settle();
    return e;
  }

  at::Tensor unpack(Entry& e, const SavedAs& saved, int64_t shift) {
    WatchPause pause;
    c10::AutoGradMode no_grad(false);
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const bool started = e.device_copy.defined();
    if (started && !e.unpacked && !e.aliased) ++stats_.prefetched;
    e.unpacked = true;
    if (e.aliased && !unchanged(e)) {
      // Written in place since it was found alive: the values saved come from the host after all.
      e.device_copy = at::Tensor();
      e.aliased = false;
      --stats_.found_on_device;
      start_to_device(e, /*may_alias=*/false, &saved);
    } else {
      start_to_device(e, /*may_alias=*/true, &saved);
    }
    if (options_.window() >= 0) {
      // Streaming: the tensors saved before this one (the backward pass's next) start coming back.
      for (size_t k = order_.size(); k-- > 0;) {
        if (order_[k].lock().get() == &e) {
          ahead(k);
          break;
        }
      }
    }
    if (e.to_device) {
      e.to_device->wait();
      e.to_device = nullptr;
    }
    // Held until autograd drops the saved tensor: bytes saved by two operators come back once.
    // As it was saved: dense, its first element at the range's start, which is where device_copy starts in
    // its storage (an offset there where found on the device, or kept to align a copy back). Before (found
    // 2026-12-04) the view was taken at the storage's start: a saved tensor at an offset into a storage still
    // alive on the device came back with another tensor's values, and its gradients were silently wrong.
    const at::Tensor values = e.device_copy.view(saved.dtype);
    return values.as_strided(saved.sizes, saved.strides, values.storage_offset() + shift);
  }

  void finish_copies() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    for (auto& w : in_flight_) {
      if (auto e = w.lock()) landed_to_host(*e);
    }
    in_flight_.clear();
  }

  void prefetch() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (options_.window() >= 0) {  // streaming: the last saved, up to a window
      ahead(order_.size());
      return;
    }
    for (auto& w : order_) {
      if (auto e = w.lock()) start_to_device(*e);
    }
  }

  OffloadStats stats() const {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return stats_;
  }

  const std::shared_ptr<HostPool>& pool() const { return options_.pool(); }

 private:
  struct Hooks final : torch::autograd::SavedVariableHooks {
    explicit Hooks(std::shared_ptr<OffloadState> s) : state(std::move(s)) {}
    void call_pack_hook(const at::Tensor& t) override {
      saved = SavedAs::of(t);
      entry = state->pack(t, &shift);
      if (!entry) {
        // Not offloaded: kept as autograd keeps it (one that requires grad detached; unpacking re-attaches
        // it).
        kept = t.requires_grad() ? t.detach() : t;
      }
    }
    at::Tensor call_unpack_hook() override {
      if (entry) return state->unpack(*entry, saved, shift);
      // Autograd does not check the version of a tensor its hooks hand back: written in place since it was
      // saved, it would give a gradient computed from the values written.
      saved.check_unmodified(kept, "remat::Offload");
      return kept;
    }
    std::shared_ptr<OffloadState> state;
    std::shared_ptr<Entry> entry;
    int64_t shift = 0;  // elements from the entry's start to the tensor's first (saved within it)
    SavedAs saved;
    at::Tensor kept;
  };

  // (storage data, byte offset, bytes, version)
  using Key = std::tuple<const void*, int64_t, int64_t, int64_t>;
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(std::get<0>(k)) ^ (std::hash<int64_t>()(std::get<1>(k)) << 1) ^
             (std::hash<int64_t>()(std::get<2>(k)) << 3) ^ (std::hash<int64_t>()(std::get<3>(k)) << 5);
    }
  };

  static const void* key_of(const at::Tensor& t) { return t.storage().data(); }

  // An entry of t's storage whose bytes, saved at t's version, hold all of t's (`shift`: t's first element's
  // distance from its start, in elements), or null. A tensor saved within bytes saved before it (a view of
  // part of a tensor saved whole: chunks of an input that an in-place activation saved) shares their entry,
  // so that they come back once, as the plain run holds them once. Before (found 2026-12-04 by the Python
  // package's random test; the same code here), each came back apart, and where both were unpacked before
  // either was dropped (retain_graph), the part was on the device twice. A part saved before the whole still
  // has an entry of its own (a limit).
  std::shared_ptr<Entry> covering(const at::Tensor& t, int64_t offset, int64_t* shift) {
    auto it = at_.find(key_of(t));
    if (it == at_.end()) return nullptr;
    const auto size = static_cast<int64_t>(t.itemsize());
    const auto nbytes = static_cast<int64_t>(t.nbytes());
    for (auto& w : it->second) {
      std::shared_ptr<Entry> e = w.lock();
      if (!e || e->version != t._version() || !e->block.defined() || e->held_storage ||
          e->storage.lock().get() != t.storage().unsafeGetStorageImpl() || offset < e->offset ||
          offset + nbytes > e->offset + e->nbytes || (offset - e->offset) % size != 0 ||
          e->nbytes % size != 0)
        continue;
      *shift = (offset - e->offset) / size;
      return e;
    }
    return nullptr;
  }

  // Whether another saved tensor that this Offload left on the device holds t's storage.
  bool left_here(const at::Tensor& t) const {
    auto it = left_on_device_.find(key_of(t));
    return it != left_on_device_.end() && it->second.lock().get() == t.storage().unsafeGetStorageImpl();
  }

  // t is saved as itself: its storage stays on the device, and an entry of that storage already offloaded is
  // found there when needed back (its host block returned once its copy has landed).
  void save_as_itself(const at::Tensor& t) {
    const void* data = plain_data(t);
    if (data == nullptr) return;
    if (left_on_device_.size() >= 2 * prune_at_) prune();
    left_on_device_.insert_or_assign(data, t.storage().getWeakStorageImpl());
    auto it = at_.find(data);
    if (it == at_.end()) return;
    for (auto& w : it->second) {
      auto e = w.lock();
      if (!e || e->held_storage || e->storage.lock().get() != t.storage().unsafeGetStorageImpl()) continue;
      // Not offloaded after all: its bytes stay on the device, found there when needed back (held by the
      // entry: the saved tensor that keeps them may be dropped first).
      e->held_storage = t.storage();
      --stats_.offloaded;
      stats_.offloaded_bytes -= e->nbytes;
      if (!e->to_host) give_back_block(*e);  // now (else once its copy lands)
    }
  }

  // Forgets what autograd has dropped (an Offload used step after step), so that the bookkeeping does not
  // grow.
  void prune() {
    auto dead = [](const std::weak_ptr<Entry>& w) { return w.expired(); };
    order_.erase(std::remove_if(order_.begin(), order_.end(), dead), order_.end());
    for (auto it = by_storage_.begin(); it != by_storage_.end();)
      it = it->second.expired() ? by_storage_.erase(it) : std::next(it);
    for (auto it = at_.begin(); it != at_.end();) {
      auto& v = it->second;
      v.erase(std::remove_if(v.begin(), v.end(), dead), v.end());
      it = v.empty() ? at_.erase(it) : std::next(it);
    }
    for (auto it = left_on_device_.begin(); it != left_on_device_.end();)
      it = it->second.expired() ? left_on_device_.erase(it) : std::next(it);
    prune_at_ = std::max<size_t>({64, order_.size(), left_on_device_.size()});
  }

  void give_back_block(Entry& e) {
    if (!e.block.defined() || e.device_copy.defined()) return;
    e.host = at::Tensor();
    e.pool->give(e.block);
    e.block = at::Tensor();
  }

  // The data of a strided tensor's storage, null for any other tensor and for a storage of keep_on_device.
  const void* plain_data(const at::Tensor& t) const {
    if (!t.defined() || t.layout() != at::kStrided || !t.has_storage() || t.is_meta()) return nullptr;
    const void* data = t.storage().data();
    return std::find(never_sent_.begin(), never_sent_.end(), data) != never_sent_.end() ? nullptr : data;
  }

  bool offloadable(const at::Tensor& t) const {
    return plain_data(t) != nullptr && sendable(t, options_.min_bytes());
  }

  // dst <- src: done (null), or a Copy in flight.
  std::shared_ptr<Copy> copy(const at::Tensor& dst, const at::Tensor& src) {
    const at::Device device = src.device().is_cpu() ? dst.device() : src.device();
    if (!device.is_cpu()) {
      c10::impl::VirtualGuardImpl impl(device.type());
      const c10::Stream current = impl.getStream(device);
      auto it = side_.find(device);
      if (it == side_.end()) it = side_.emplace(device, impl.getStreamFromGlobalPool(device, false)).first;
      const c10::Stream side = it->second;
      c10::Event ready(device.type());
      ready.record(current);
      ready.block(side);  // the copy starts after the work that produced its source
      {
        c10::StreamGuard guard(side);
        dst.copy_(src, /*non_blocking=*/true);
      }
      auto done = std::make_shared<c10::Event>(device.type());
      done->record(side);
      // The destination may be a device tensor made on the current stream, freed after this copy's work.
      if (!dst.device().is_cpu()) dst.record_stream(side);
      return std::make_shared<Copy>(Copy{[done] { return done->query(); },
                                         [done, current] {
                                           done->block(current);
                                           while (!done->query())
                                             std::this_thread::yield();
                                         }});
    }
    if (options_.copy_delay() <= 0) {
      dst.copy_(src);
      return nullptr;
    }
    // Late on purpose (tests): held weakly, carried out when waited for or `copy_delay` copies later.
    auto p = std::make_shared<Pending>(
        Pending{dst, c10::weak_intrusive_ptr<c10::TensorImpl>(src.getIntrusivePtr())});
    pending_.push_back(p);
    while (static_cast<int>(pending_.size()) > options_.copy_delay())
      complete(*pending_.front());
    std::weak_ptr<OffloadState> self = weak_from_this();
    return std::make_shared<Copy>(Copy{[p] { return p->done; },
                                       [p, self] {
                                         if (auto s = self.lock()) s->complete(*p);
                                       }});
  }

  struct Pending {
    at::Tensor dst;
    c10::weak_intrusive_ptr<c10::TensorImpl> src;
    bool done = false;
  };

  void complete(Pending& p) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (p.done) return;
    auto src = p.src.lock();
    TORCH_CHECK(src, "remat::Offload: a copy's source was released before the copy completed");
    c10::AutoGradMode no_grad(false);
    p.dst.copy_(at::Tensor(std::move(src)));
    p.done = true;
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(), [](const auto& q) { return q->done; }),
                   pending_.end());
  }

  // Streaming: waits for the oldest copies to the host until at most a window of bytes is in flight.
  void bound_in_flight() {
    std::vector<std::shared_ptr<Entry>> flying;
    int64_t total = 0;
    for (auto& w : in_flight_) {
      auto e = w.lock();
      if (e && e->source.defined()) {
        total += e->nbytes;
        flying.push_back(std::move(e));
      }
    }
    for (auto& e : flying) {
      if (total <= options_.window()) break;
      landed_to_host(*e);
      total -= e->nbytes;
    }
    in_flight_.clear();
    for (auto& e : flying)
      if (e->source.defined()) in_flight_.push_back(e);
  }

  // Streaming: starts bringing back the tensors saved before the i-th of order_, the nearest first, while
  // those on their way and not yet asked for stay within a window of bytes (the options' by default), those
  // saved after it among them: a backward pass may use its saved tensors out of the order they were saved in
  // (an MoE layer's experts), and a tensor brought back ahead stays until it is asked for. Before (found
  // 2026-12-05 in the Python runtime, the same code), only those saved before it counted. With `found`
  // (storages), starts nothing and returns the bytes it would copy back, those storages taken as found on
  // the device (no copy, nothing of the window).
  int64_t ahead(size_t i, int64_t window = -1, const std::vector<const c10::StorageImpl*>* found = nullptr) {
    if (window < 0) window = options_.window();
    int64_t bytes = 0, copied = 0;
    if (!found) {
      for (size_t k = i; k < order_.size(); ++k) {
        auto other = order_[k].lock();
        if (other && other->device_copy.defined() && !other->unpacked && !other->aliased)
          bytes += other->nbytes;
      }
    }
    for (size_t k = i; k-- > 0;) {
      auto other = order_[k].lock();
      if (!other || other->unpacked || other->aliased) continue;
      if (other->device_copy.defined()) {  // on its way already
        bytes += other->nbytes;
        continue;
      }
      if (!other->block.defined() || other->held_storage) continue;  // not on the host
      if (found &&
          std::find(found->begin(), found->end(), other->storage._unsafe_get_target()) != found->end())
        continue;
      if (bytes + other->nbytes > window) break;
      if (!found) start_to_device(*other);
      if (!other->aliased) bytes += other->nbytes, copied += other->nbytes;
    }
    return copied;
  }

 public:
  // Offload::ahead_bytes.
  int64_t ahead_bytes(int64_t window, const std::vector<at::Tensor>& maybe_found) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    std::vector<const c10::StorageImpl*> candidates;
    for (const at::Tensor& t : maybe_found) {
      if (t.defined() && t.has_storage()) candidates.push_back(t.storage().unsafeGetStorageImpl());
    }
    TORCH_CHECK(candidates.size() < 16, "remat::Offload::ahead_bytes: at most 15 tensors may be found, got ",
                candidates.size());
    int64_t most = 0;
    for (size_t pick = 0; pick < (size_t{1} << candidates.size()); ++pick) {
      std::vector<const c10::StorageImpl*> found;
      for (size_t k = 0; k < candidates.size(); ++k)
        if (pick >> k & 1) found.push_back(candidates[k]);
      most = std::max(most, ahead(order_.size(), window, &found));
    }
    return most;
  }

 private:
  // Releases the device tensors whose copies to the host have completed (queried, not waited for).
  void settle() {
    std::vector<std::weak_ptr<Entry>> still;
    for (auto& w : in_flight_) {
      auto e = w.lock();
      if (!e || !e->source.defined()) continue;
      if (e->to_host && e->to_host->query()) {
        landed_to_host(*e);
      } else {
        still.push_back(w);
      }
    }
    in_flight_ = std::move(still);
  }

  void landed_to_host(Entry& e) {
    if (e.to_host) {
      e.to_host->wait();
      e.to_host = nullptr;
      // Written in place while its copy was in flight: the host may hold half old, half new values.
      TORCH_CHECK(
          e.copied_at_once || !e.source.defined() || e.source._version() == e.version,
          "remat::Offload: a tensor saved for backward (", e.nbytes,
          " bytes) was modified by an in-place operation while its copy to the host was in flight; its "
          "gradient would read values half old, half new. Clone it before the in-place operation, or "
          "leave that operation outside the Offload");
    }
    e.source = at::Tensor();
    if (e.held_storage) give_back_block(e);  // the storage stays on the device: the host copy is not needed
  }

  static bool unchanged(const Entry& e) {
    return e.counter.enabled() && static_cast<int64_t>(e.counter.current_version()) == e.version;
  }

  // `saved`: the tensor being unpacked, for the error raised when its bytes were kept on the device and
  // written there since.
  void start_to_device(Entry& e, bool may_alias = true, const SavedAs* saved = nullptr) {
    if (e.device_copy.defined()) return;
    // Still on the device (held there by another holder, such as the stage before, whose output it is, or a
    // saved tensor autograd keeps as itself) and not written since: those bytes themselves; a copy back would
    // be a second one.
    if (may_alias && unchanged(e)) {
      if (c10::intrusive_ptr<c10::StorageImpl> alive = e.storage.lock()) {
        landed_to_host(e);
        at::Tensor t = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(e.device));
        t.set_(c10::Storage(std::move(alive)), e.offset, {e.nbytes}, {1});
        e.device_copy = t;
        e.aliased = true;
        ++stats_.found_on_device;
        return;
      }
    }
    if (!e.block.defined()) {
      // Kept on the device (its host block returned) and written there since: the values saved are gone.
      TORCH_INTERNAL_ASSERT(e.held_storage, "remat::Offload: an offloaded entry without its host block");
      if (saved != nullptr) {
        saved->check_version(
            e.counter.enabled() ? static_cast<int64_t>(e.counter.current_version()) : e.version, e.device,
            "remat::Offload");
      }
      return;  // a prefetch: the unpack raises
    }
    landed_to_host(e);
    e.device_copy = aligned_as(e.align, e.nbytes, e.device);
    stats_.alignment_bytes += static_cast<int64_t>(e.device_copy.storage().nbytes()) - e.nbytes;
    e.to_device = copy(e.device_copy, e.host);
    ++stats_.brought_back;
  }

  OffloadOptions options_;
  std::vector<const void*> never_sent_;  // storages of OffloadOptions::keep_on_device
  mutable std::recursive_mutex mu_;
  std::unordered_map<Key, std::weak_ptr<Entry>, KeyHash> by_storage_;
  std::unordered_map<const void*, std::vector<std::weak_ptr<Entry>>> at_;  // a storage's entries
  // Storages of saved tensors this Offload left on the device (weakly: autograd holds them).
  std::unordered_map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> left_on_device_;
  std::vector<std::weak_ptr<Entry>> order_, in_flight_;
  size_t prune_at_ = 64;  // prune() once order_ holds twice this many
  std::deque<std::shared_ptr<Pending>> pending_;
  std::unordered_map<at::Device, c10::Stream> side_;
  OffloadStats stats_;
};

}  // namespace detail

// ------------------------------------------------------------------------------------------------------------
// Offload

Offload::Offload(OffloadOptions options) {
  TORCH_CHECK(options.min_bytes() >= 0, "remat::Offload: min_bytes must be >= 0, got ", options.min_bytes());
  TORCH_CHECK(options.copy_delay() >= 0, "remat::Offload: copy_delay must be >= 0, got ",
              options.copy_delay());
  TORCH_CHECK(options.window() >= -1, "remat::Offload: window must be >= 0 (bytes), or -1 for none, got ",
              options.window());
  detail::require_engine("remat::Offload");
  state_ = std::make_shared<detail::OffloadState>(std::move(options));
  scope_ = std::make_unique<detail::HookScope>(state_.get());
}

Offload::~Offload() {
  close();
}

void Offload::close() {
  scope_.reset();
}

void Offload::finish_copies() {
  state_->finish_copies();
}

void Offload::prefetch() {
  state_->prefetch();
}

int64_t Offload::ahead_bytes(int64_t window, const std::vector<at::Tensor>& maybe_found) const {
  TORCH_CHECK(window >= 0, "remat::Offload::ahead_bytes: window must be >= 0 (bytes), got ", window);
  return state_->ahead_bytes(window, maybe_found);
}

OffloadStats Offload::stats() const {
  return state_->stats();
}

const std::shared_ptr<HostPool>& Offload::pool() const {
  return state_->pool();
}

OffloadBandwidth offload_bandwidth(c10::Device device, int64_t nbytes, int repeats) {
  TORCH_CHECK(repeats >= 1, "remat::offload_bandwidth: repeats must be >= 1, got ", repeats);
  nbytes = std::max<int64_t>(nbytes, int64_t{64} << 10);
  HostPool pool(-1, device.is_cuda());
  const at::Tensor host = pool.take(nbytes).narrow(0, 0, nbytes);
  const at::Tensor dev = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device));
  std::optional<c10::impl::VirtualGuardImpl> impl;
  if (!device.is_cpu()) impl.emplace(device.type());
  auto sync = [&] {
    if (!impl) return;
    c10::Event e(device.type());
    e.record(impl->getStream(device));
    while (!e.query())
      std::this_thread::yield();
  };
  std::vector<double> to_host, to_device;
  c10::AutoGradMode no_grad(false);
  for (int r = 0; r <= repeats; ++r) {
    for (bool up : {true, false}) {
      sync();
      const auto t0 = std::chrono::steady_clock::now();
      if (up) {
        host.copy_(dev, /*non_blocking=*/impl.has_value());
      } else {
        dev.copy_(host, /*non_blocking=*/impl.has_value());
      }
      sync();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) (up ? to_host : to_device).push_back(s);
    }
  }
  auto gbps = [&](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return static_cast<double>(nbytes) / std::max(v[v.size() / 2], 1e-9) / 1e9;
  };
  return {gbps(to_host), gbps(to_device)};
}

}  // namespace remat
