// The block/warp emulator behind cuda/sim_device.h: cooperative fibers (ucontext), one per
// emulated thread of the running block; blocks of a grid run one after another.
#include <ucontext.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/sim_device.h"

namespace mep_sim {
namespace {

constexpr size_t kStackBytes = 128 * 1024;
constexpr uint64_t kMaxIdleRounds = 2'000'000;  // rounds without progress or an outside wait: a deadlock
constexpr uint64_t kSpinRounds = 64;            // rounds of pure outside waits before the scheduler sleeps

struct Fiber {
    ucontext_t context;
    dim3 index;
    bool done = false;
};

struct Warp {
    int lanes = 0;
    int arrived = 0;
    uint64_t generation = 0;
    uint32_t values[32] = {};
};

struct Block {
    dim3 index, dim, grid;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    int current = -1;
    int block_arrived = 0;
    uint64_t block_generation = 0;
    uint64_t progress = 0;  // barriers completed + threads finished
    uint64_t pauses = 0;    // __nanosleep calls: waits on something outside the block
    ucontext_t scheduler;
    const std::function<void()>* body = nullptr;
    std::vector<unsigned char> shared;
};

Block* running = nullptr;
bool blocks_reversed = false;  // set_block_order
std::vector<std::unique_ptr<char[]>> stacks;  // reused between launches

Block& block() {
    if (running == nullptr || running->current < 0) throw std::logic_error("mep_sim: called outside a kernel");
    return *running;
}

Fiber& self() { return block().fibers[size_t(block().current)]; }

int thread_rank() {
    const dim3 t = self().index;
    return int(t.x + t.y * block().dim.x + t.z * block().dim.x * block().dim.y);
}

void trampoline() {
    Block& b = *running;
    (*b.body)();
    b.fibers[size_t(b.current)].done = true;
    ++b.progress;
    // returning resumes uc_link: the scheduler
}

void warp_barrier() {
    Block& b = block();
    Warp& w = b.warps[size_t(thread_rank() / 32)];
    const uint64_t generation = w.generation;
    if (++w.arrived == w.lanes) {
        w.arrived = 0;
        ++w.generation;
        ++b.progress;
        return;
    }
    while (w.generation == generation) yield();
}

}  // namespace

dim3 thread_index() { return self().index; }
dim3 block_index() { return block().index; }
dim3 block_dim() { return block().dim; }
dim3 grid_dim() { return block().grid; }

void yield() {
    Block& b = block();
    Fiber& me = self();
    swapcontext(&me.context, &b.scheduler);
}

void sync_threads() {
    Block& b = block();
    const uint64_t generation = b.block_generation;
    if (++b.block_arrived == int(b.fibers.size())) {
        b.block_arrived = 0;
        ++b.block_generation;
        ++b.progress;
        return;
    }
    while (b.block_generation == generation) yield();
}

void sync_warp() { warp_barrier(); }

unsigned ballot(bool predicate) {
    Block& b = block();
    const int rank = thread_rank();
    Warp& w = b.warps[size_t(rank / 32)];
    w.values[rank % 32] = predicate ? 1u : 0u;
    warp_barrier();
    unsigned mask = 0;
    for (int lane = 0; lane < w.lanes; ++lane) mask |= w.values[lane] << lane;
    warp_barrier();  // nobody overwrites a value before every lane has read them all
    return mask;
}

uint32_t shuffle_xor(uint32_t value, int lane_mask) {
    Block& b = block();
    const int rank = thread_rank();
    Warp& w = b.warps[size_t(rank / 32)];
    const int lane = rank % 32;
    w.values[lane] = value;
    warp_barrier();
    const int from = lane ^ lane_mask;
    const uint32_t got = from < w.lanes ? w.values[from] : value;
    warp_barrier();
    return got;
}

void pause() {
    ++block().pauses;
    yield();
}

uint64_t timer_ns() {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count());
}

unsigned char* dynamic_shared_bytes() { return block().shared.data(); }

void run_grid(dim3 grid, dim3 dim, size_t shared_bytes, const std::function<void()>& body) {
    if (running != nullptr) throw std::logic_error("mep_sim: a launch inside a kernel");
    const size_t threads = size_t(dim.x) * dim.y * dim.z;
    if (threads == 0 || threads > 1024) throw std::invalid_argument("mep_sim: block size must be in [1, 1024]");
    while (stacks.size() < threads) stacks.emplace_back(new char[kStackBytes]);
    const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
    for (uint64_t n = 0; n < blocks; ++n) {
        const uint64_t i = blocks_reversed ? blocks - 1 - n : n;  // x fastest, as a GPU numbers blocks
        Block b;
        b.index = dim3(unsigned(i % grid.x), unsigned(i / grid.x % grid.y),
                       unsigned(i / (uint64_t(grid.x) * grid.y)));
        b.dim = dim;
        b.grid = grid;
        b.body = &body;
        b.shared.assign(shared_bytes + 16, 0);
        b.fibers.resize(threads);
        b.warps.resize((threads + 31) / 32);
        for (size_t w = 0; w < b.warps.size(); ++w) b.warps[w].lanes = int(std::min<size_t>(32, threads - 32 * w));
        for (size_t t = 0; t < threads; ++t) {
            Fiber& f = b.fibers[t];
            f.index = dim3(unsigned(t % dim.x), unsigned(t / dim.x % dim.y), unsigned(t / (size_t(dim.x) * dim.y)));
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = stacks[t].get();
            f.context.uc_stack.ss_size = kStackBytes;
            f.context.uc_link = &b.scheduler;
            makecontext(&f.context, trampoline, 0);
        }
        running = &b;
        uint64_t idle = 0, waiting = 0, seen = b.progress, paused = b.pauses;
        std::string error;
        for (;;) {
            bool alive = false;
            for (size_t t = 0; t < threads; ++t) {
                if (b.fibers[t].done) continue;
                alive = true;
                b.current = int(t);
                swapcontext(&b.scheduler, &b.fibers[t].context);
            }
            b.current = -1;
            if (!alive) break;
            if (b.progress != seen) {
                seen = b.progress;
                idle = waiting = 0;
            } else if (b.pauses != paused) {  // only waits on other ranks: back off politely
                paused = b.pauses;
                idle = 0;
                if (++waiting > kSpinRounds) std::this_thread::sleep_for(std::chrono::microseconds(20));
            } else if (++idle > kMaxIdleRounds) {
                error = "mep_sim: block (" + std::to_string(b.index.x) + ", " + std::to_string(b.index.y) + ", " +
                        std::to_string(b.index.z) +
                        ") made no progress: a barrier or warp collective that some thread never reaches";
                break;
            }
        }
        running = nullptr;
        if (!error.empty()) throw std::runtime_error(error);  // the fibers' stacks are abandoned
    }
}

void set_block_order(bool reversed) { blocks_reversed = reversed; }

}  // namespace mep_sim
