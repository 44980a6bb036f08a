// InboundReaper: shut down this process's accepted TCP connections on one listening port,
// from a native thread, for as long as it runs.
//
// The Transfer Engine's handshake listener reads each inbound handshake in its one thread with a
// 5 s receive timeout per read, and its destructor joins that thread while holding the GIL: a peer
// that stopped (or trickles bytes) in the middle of a handshake holds the engine's destruction, and
// the whole interpreter, for as long as it likes. A Python thread cannot help while the destructor
// holds the GIL, so this one is native: started before the engine is released, stopped after.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>

namespace mep {

class InboundReaper {
public:
    // port: the local TCP port whose accepted connections (not the listening socket) are shut down.
    // period_s: seconds between scans of /proc/self/fd (> 0); max_s: the thread ends by itself after this long.
    // report_after_s: if still running after this long (0: never), write once to stderr what every thread
    // of the process is blocked in (/proc/self/task: name, wchan, syscall), so a teardown that takes long
    // names its cause even while it holds the GIL.
    InboundReaper(int64_t port, double period_s, double max_s, double report_after_s = 0.0);
    ~InboundReaper();
    InboundReaper(const InboundReaper&) = delete;
    InboundReaper& operator=(const InboundReaper&) = delete;

    // End the scans and join the thread (idempotent). Returns how many sockets were shut down.
    int64_t stop();
    int64_t aborted() const { return aborted_.load(); }
    bool reported() const { return reported_.load(); }

private:
    void run();
    int port_;
    int64_t period_us_;
    int64_t max_us_;
    int64_t report_us_;
    std::atomic<bool> reported_{false};
    std::mutex stop_mutex_;
    std::atomic<bool> running_{true};
    std::atomic<int64_t> aborted_{0};
    std::thread thread_;
};

// One scan: shut down this process's connected TCP sockets whose local port is `port` (found through
// /proc/self/fd: only socket descriptors are duplicated; getsockname on the duplicate, so any network
// namespace works). Returns how many.
int64_t shutdown_inbound(int64_t port);

// What every thread of this process is doing, one line each ("tid name wchan=... syscall=..."), at most
// `max_threads` lines; read from /proc/self/task without the GIL.
std::string thread_report(int64_t max_threads);

}  // namespace mep
