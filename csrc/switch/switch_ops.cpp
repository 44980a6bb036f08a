// Native helpers of runtime TP<->EP switching (mooncake_ep_switch/switch/): a batched, bounds-checked
// strided copy (weight reshard and KV page moves write straight into a peer's mapped region), a wait
// on several signal words with one deadline and the shared backoff, and page pre-faulting of mapped
// regions (so that the first switch does not pay page faults inside its timed copies).
#include <errno.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <limits>

#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "switch/api.h"
#include "common/mep_common.h"

namespace mep {

namespace {

// Highest byte address + 1 touched by a block of `rows` rows of `row_bytes` at `stride`, or throws.
uintptr_t block_end(uintptr_t start, int64_t rows, int64_t row_bytes, int64_t stride, int64_t index,
                    const char* side) {
    if (rows < 0 || row_bytes < 0 || stride < 0) {
        throw_value_error("copy_blocks: block " + std::to_string(index) + " has a negative " + side +
                          " rows/row_bytes/stride (" + std::to_string(rows) + ", " + std::to_string(row_bytes) +
                          ", " + std::to_string(stride) + ")");
    }
    if (rows == 0 || row_bytes == 0) return start;
    int64_t span;
    if (__builtin_mul_overflow(rows - 1, stride, &span) || __builtin_add_overflow(span, row_bytes, &span)) {
        throw_value_error("copy_blocks: block " + std::to_string(index) + " " + side + " extent overflows int64");
    }
    uintptr_t end;
    if (__builtin_add_overflow(start, uintptr_t(span), &end)) {
        throw_value_error("copy_blocks: block " + std::to_string(index) + " " + side + " address overflows");
    }
    return end;
}

void check_inside(uintptr_t start, uintptr_t end, uintptr_t lo, uintptr_t hi, int64_t index, const char* side) {
    if (start < lo || end > hi) {
        throw_value_error(std::string("copy_blocks: block ") + std::to_string(index) + " " + side + " range [" +
                          std::to_string(start) + ", " + std::to_string(end) + ") is outside its region [" +
                          std::to_string(lo) + ", " + std::to_string(hi) + ")");
    }
}

// Calls moving at least this many bytes use non-temporal stores (for rows of >= 256 bytes): the
// destination (a peer's free slot or free KV units) is not read again soon, and streaming stores
// skip the read-for-ownership of every destination line, which is what makes glibc's memcpy fast
// on large copies.
constexpr int64_t kStreamMinBytes = 256 * 1024;

// wait_words: polls before the first sleep, and the longest sleep between polls (a publisher that
// does not wake, e.g. one writing through another transport, is seen within this).
constexpr int kWaitSpins = 256;
constexpr int64_t kWaitSleepNs = 1000 * 1000;

#if defined(__SSE2__)
// dst <- src (n bytes) with 16-byte streaming stores for the aligned middle; the caller fences.
void stream_copy(char* dst, const char* src, size_t n) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    if (n < head + 64) {
        std::memcpy(dst, src, n);
        return;
    }
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
}
#endif

}  // namespace

void copy_blocks(uintptr_t desc_ptr, int64_t n, uintptr_t dst_lo, uintptr_t dst_hi, uintptr_t src_lo,
                 uintptr_t src_hi) {
    if (n < 0) throw_value_error("copy_blocks: n = " + std::to_string(n) + " must be >= 0");
    if (n == 0) return;
    check_nonnull(desc_ptr, "desc_ptr");
    const int64_t* desc = reinterpret_cast<const int64_t*>(desc_ptr);
    // Validate every block before writing anything: a bad plan writes nothing.
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t* d = desc + 6 * i;
        const uintptr_t dst = uintptr_t(d[0]), src = uintptr_t(d[1]);
        const uintptr_t dst_end = block_end(dst, d[2], d[3], d[4], i, "destination");
        const uintptr_t src_end = block_end(src, d[2], d[3], d[5], i, "source");
        check_inside(dst, dst_end, dst_lo, dst_hi, i, "destination");
        check_inside(src, src_end, src_lo, src_hi, i, "source");
        total += int64_t(dst_end - dst);
    }
    const bool stream = total >= kStreamMinBytes;
    bool streamed = false;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t* d = desc + 6 * i;
        char* dst = reinterpret_cast<char*>(uintptr_t(d[0]));
        const char* src = reinterpret_cast<const char*>(uintptr_t(d[1]));
        int64_t rows = d[2], row_bytes = d[3];
        const int64_t dst_stride = d[4], src_stride = d[5];
        if (rows == 0 || row_bytes == 0) continue;
        if (dst_stride == row_bytes && src_stride == row_bytes) {  // one contiguous run
            row_bytes *= rows;
            rows = 1;
        }
#if defined(__SSE2__)
        if (stream && row_bytes >= 256) {
            streamed = true;
            for (int64_t r = 0; r < rows; ++r) {
                stream_copy(dst + r * dst_stride, src + r * src_stride, size_t(row_bytes));
            }
            continue;
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
            std::memcpy(dst + r * dst_stride, src + r * src_stride, size_t(row_bytes));
        }
    }
#if defined(__SSE2__)
    if (streamed) _mm_sfence();  // streaming stores are weakly ordered: finish them before any signal
#endif
}

int64_t kv_peer_blocks(uintptr_t moves_ptr, int64_t num_moves, int64_t rank, int64_t num_ranks,
                       const std::vector<int64_t>& peers, const std::vector<uint64_t>& pool_bases,
                       const KVBlockGeometry& geometry, uintptr_t out_ptr, int64_t capacity, uintptr_t bounds_ptr,
                       bool sending) {
    if (num_moves < 0) throw_value_error("kv_peer_blocks: num_moves = " + std::to_string(num_moves) + " must be >= 0");
    if (num_ranks <= 0 || rank < 0 || rank >= num_ranks) {
        throw_value_error("kv_peer_blocks: rank " + std::to_string(rank) + " must be in [0, " +
                          std::to_string(num_ranks) + ")");
    }
    if (int64_t(pool_bases.size()) != num_ranks) {
        throw_value_error("kv_peer_blocks: pool_bases has " + std::to_string(pool_bases.size()) +
                          " entries, expected " + std::to_string(num_ranks));
    }
    const KVBlockGeometry& g = geometry;
    if (g.num_units <= 0 || g.unit_bytes <= 0 || g.heads <= 0 || g.head_bytes <= 0 || g.page_size <= 0 ||
        g.token_bytes <= 0 || g.planes <= 0 || g.plane_bytes <= 0) {
        throw_value_error("kv_peer_blocks: the geometry's sizes must be positive");
    }
    // One pool's geometry: a head's page is page_size token rows, a unit `heads` of them, a plane num_units units.
    // Checked without overflow, so every address below (unit * unit_bytes + h * head_bytes < plane_bytes) is too.
    int64_t head = 0, unit = 0, plane = 0;
    if (__builtin_mul_overflow(g.page_size, g.token_bytes, &head) || head != g.head_bytes ||
        __builtin_mul_overflow(g.heads, g.head_bytes, &unit) || unit != g.unit_bytes ||
        __builtin_mul_overflow(g.num_units, g.unit_bytes, &plane) || plane != g.plane_bytes) {
        throw_value_error("kv_peer_blocks: the geometry is not one pool's (expected head_bytes = page_size * "
                          "token_bytes, unit_bytes = heads * head_bytes, plane_bytes = num_units * unit_bytes)");
    }
    if (num_moves > std::numeric_limits<int64_t>::max() / 6 / g.heads) {  // the table's int64 count and index
        throw_value_error("kv_peer_blocks: num_moves = " + std::to_string(num_moves) + " is too large");
    }
    // Position of each rank in `peers` (-1: not wanted), each at most once.
    std::vector<int64_t> slot(size_t(num_ranks), -1);
    for (size_t i = 0; i < peers.size(); ++i) {
        const int64_t p = peers[i];
        if (p < 0 || p >= num_ranks || slot[size_t(p)] >= 0) {
            throw_value_error("kv_peer_blocks: peers must be distinct ranks in [0, " + std::to_string(num_ranks) +
                              "), got " + std::to_string(p) + " at " + std::to_string(i));
        }
        slot[size_t(p)] = int64_t(i);
    }
    if (num_moves > 0) check_nonnull(moves_ptr, "moves_ptr");
    check_nonnull(bounds_ptr, "bounds_ptr");
    const int64_t* moves = reinterpret_cast<const int64_t*>(moves_ptr);
    const int mine = sending ? 0 : 2, other = sending ? 2 : 0;
    // Count each wanted peer's moves (and check every move used) before writing anything.
    std::vector<int64_t> count(peers.size() + 1, 0);
    for (int64_t m = 0; m < num_moves; ++m) {
        const int64_t* row = moves + 5 * m;
        if (row[mine] != rank) continue;
        const int64_t peer = row[other];
        if (peer < 0 || peer >= num_ranks) {
            throw_value_error("kv_peer_blocks: move " + std::to_string(m) + " names rank " + std::to_string(peer) +
                              ", outside [0, " + std::to_string(num_ranks) + ")");
        }
        if (slot[size_t(peer)] < 0) continue;
        if (row[1] < 0 || row[1] >= g.num_units || row[3] < 0 || row[3] >= g.num_units || row[4] < 0 ||
            row[4] > g.page_size) {
            throw_value_error("moves: expected units in [0, " + std::to_string(g.num_units) +
                              ") and filled tokens in [0, " + std::to_string(g.page_size) + "], got move " +
                              std::to_string(m) + " = (" + std::to_string(row[0]) + ", " + std::to_string(row[1]) +
                              ", " + std::to_string(row[2]) + ", " + std::to_string(row[3]) + ", " +
                              std::to_string(row[4]) + ")");
        }
        ++count[size_t(slot[size_t(peer)]) + 1];
    }
    std::vector<int64_t> next(peers.size() + 1, 0);  // each peer's first block, then the end
    for (size_t i = 0; i < peers.size(); ++i) next[i + 1] = next[i] + count[i + 1] * g.heads;
    const int64_t total = next[peers.size()];
    if (total > capacity) {
        throw_value_error("kv_peer_blocks: " + std::to_string(total) + " blocks do not fit the table's " +
                          std::to_string(capacity));
    }
    if (total > 0) check_nonnull(out_ptr, "out_ptr");
    std::memcpy(reinterpret_cast<int64_t*>(bounds_ptr), next.data(), next.size() * sizeof(int64_t));
    if (total == 0) return 0;
    int64_t* out = reinterpret_cast<int64_t*>(out_ptr);
    for (int64_t m = 0; m < num_moves; ++m) {  // in the moves' order within a peer
        const int64_t* row = moves + 5 * m;
        if (row[mine] != rank || slot[size_t(row[other])] < 0) continue;
        const int64_t src_rank = row[0], dst_rank = row[2];
        const uint64_t src = pool_bases[size_t(src_rank)] + uint64_t(row[1] * g.unit_bytes);
        const uint64_t dst = pool_bases[size_t(dst_rank)] + uint64_t(row[3] * g.unit_bytes);
        int64_t* block = out + 6 * next[size_t(slot[size_t(row[other])])];
        for (int64_t h = 0; h < g.heads; ++h, block += 6) {
            block[0] = int64_t(dst + uint64_t(h * g.head_bytes));
            block[1] = int64_t(src + uint64_t(h * g.head_bytes));
            block[2] = g.planes;
            block[3] = row[4] * g.token_bytes;
            block[4] = g.plane_bytes;
            block[5] = g.plane_bytes;
        }
        next[size_t(slot[size_t(row[other])])] += g.heads;
    }
    return total;
}

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "signal words: low half first");

// The 32-bit half of a signal word that changes when the word moves toward `mode`'s goal: the tag
// (high half) for tag equality, the count/step (low half) for progress words.
inline const uint32_t* watched_half(uintptr_t word, int64_t mode) {
    return reinterpret_cast<const uint32_t*>(word) + (mode == 0 ? 1 : 0);
}

void futex_wake_all(const void* half) {
    syscall(SYS_futex, half, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

void signal_publish(uintptr_t addr, uint64_t value) {
    if (addr == 0 || addr % 8 != 0) {
        throw_value_error("signal_publish: address " + std::to_string(addr) + " must be nonzero and 8-aligned");
    }
    store_release(reinterpret_cast<void*>(addr), value);
    futex_wake_all(reinterpret_cast<const uint32_t*>(addr));      // progress waiters (low half)
    futex_wake_all(reinterpret_cast<const uint32_t*>(addr) + 1);  // tag waiters (high half)
}

std::vector<int64_t> wait_words(const std::vector<uintptr_t>& addrs, const std::vector<uint64_t>& expected,
                                int64_t mode, int64_t timeout_us) {
    if (addrs.size() != expected.size()) {
        throw_value_error("wait_words: addrs has " + std::to_string(addrs.size()) + " entries, expected has " +
                          std::to_string(expected.size()));
    }
    if (mode != 0 && mode != 1) throw_value_error("wait_words: mode = " + std::to_string(mode) + " must be 0 or 1");
    for (uintptr_t a : addrs) {
        if (a == 0 || a % 8 != 0) {
            throw_value_error("wait_words: signal address " + std::to_string(a) + " must be nonzero and 8-aligned");
        }
    }
    check_timeout(timeout_us);
    const int64_t deadline = timeout_us < 0 ? -1 : monotonic_ns() + std::min<int64_t>(timeout_us, 1LL << 40) * 1000;
    std::vector<int64_t> pending;
    for (size_t i = 0; i < addrs.size(); ++i) pending.push_back(int64_t(i));
    int spins = 0;
    while (true) {
        std::vector<int64_t> still;
        for (int64_t i : pending) {
            const uint64_t v = load_acquire(reinterpret_cast<const void*>(addrs[size_t(i)]));
            const uint64_t e = expected[size_t(i)];
            const bool ok = mode == 0 ? (v >> 32) == (e >> 32) : v >= e;
            if (!ok) still.push_back(i);
        }
        pending.swap(still);
        const int64_t now = monotonic_ns();
        if (pending.empty() || (deadline >= 0 && now >= deadline)) return pending;
        if (spins < kWaitSpins) {  // the peer is often about to publish: spin a little first
            ++spins;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            continue;
        }
        // Then sleep on the first missing word until its publisher wakes us (signal_publish), at
        // most kWaitSleepNs and never past the deadline: the core goes to the ranks still copying.
        const uint32_t* half = watched_half(addrs[size_t(pending[0])], mode);
        const uint32_t seen = __atomic_load_n(half, __ATOMIC_ACQUIRE);
        int64_t ns = kWaitSleepNs;
        if (deadline >= 0) ns = std::min(ns, deadline - now);
        timespec ts{time_t(ns / 1000000000LL), long(ns % 1000000000LL)};
        syscall(SYS_futex, half, FUTEX_WAIT, seen, &ts, nullptr, 0);  // returns early if it changed
    }
}

void prefault(uintptr_t base, int64_t nbytes) {
    check_nonnull(base, "base");
    if (nbytes <= 0) return;
    const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t start = base / page * page;
    const uintptr_t end = base + uintptr_t(nbytes);
#ifdef MADV_POPULATE_WRITE
    if (madvise(reinterpret_cast<void*>(start), size_t(end - start), MADV_POPULATE_WRITE) == 0) return;
#endif
    // Older kernels: touch every page with a write that leaves its value unchanged (safe even if a
    // peer writes the same page concurrently).
    for (uintptr_t p = start < base ? base : start; p < end; p += page) {
        __atomic_fetch_add(reinterpret_cast<uint8_t*>(p), uint8_t(0), __ATOMIC_RELAXED);
    }
}

}  // namespace mep
