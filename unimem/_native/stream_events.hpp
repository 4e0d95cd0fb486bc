// The stream events the core waits for, as native data (PyTorch's
// cuda_events: per stream, a queue of (event, block) in the order recorded).
//
// Every field is read and changed with the core's lock held, and nothing
// here runs Python: an entry owns a reference to its event object, and a
// reference to drop goes to ``to_release``, dropped by the core once the
// lock is let go (dropping the last one may run Python). An entry ``taken``
// is being asked about (or waited for) by one thread with the lock let go:
// no other thread asks about it then, since a backend's answer "done"
// destroys the event.
#pragma once
#include <Python.h>
#include <cstdint>
#include <deque>
#include <map>
#include <vector>

struct um_pending_event {
    PyObject* event;    // owned; NULL once the backend said it is done
    void* block;        // the Block* waiting for it; NULL once held pages were taken back
    uint64_t seq;       // increasing along each queue
    bool taken;
};

typedef std::deque<um_pending_event> um_event_queue;

// One event copied out under the lock, asked about outside it.
struct um_event_ask {
    PyObject* event;    // borrowed from its entry (taken: nobody else drops it)
    uintptr_t stream;
    uint64_t seq;
};

struct UMStreamEvents {
    std::map<uintptr_t, um_event_queue> queues;
    size_t count = 0;                   // entries in all the queues
    uint64_t next_seq = 1;
    size_t known_done = 0;              // at most this many entries are done with their block not yet handled
    std::vector<um_event_ask> spare_asks;   // a vector with room, lent to one process_events at a time
    std::vector<PyObject*> to_release;  // references to drop once the lock is let go
    std::vector<void*> recording;       // Block*s whose events are being recorded, lock let go
};

// 0, or -1 when host memory ran out (nothing changed then). The reference
// to ``event`` is the caller's to give (it is taken only on success).
static inline int um_events_add(UMStreamEvents& ev, PyObject* event, void* block, uintptr_t stream) noexcept {
    try {
        ev.queues[stream].push_back(um_pending_event{event, block, ev.next_seq, false});
    } catch (...) {
        return -1;
    }
    ev.next_seq++;
    ev.count++;
    return 0;
}

// The position in ``q`` of the entry numbered ``seq``, or -1 (taken off meanwhile).
static inline long um_events_index(um_event_queue& q, uint64_t seq) noexcept {
    if (!q.empty() && q.front().seq == seq)
        return 0;       // the stream's oldest, what process_events asks about
    size_t lo = 0, hi = q.size();
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (q[mid].seq < seq) lo = mid + 1; else hi = mid;
    }
    return lo < q.size() && q[lo].seq == seq ? (long)lo : -1;
}

// Take the entry at ``i`` out of ``q``; its event, if any, goes to
// to_release (with no host memory for that, its reference is kept for
// ever: a leak of one small object, never a Python call under the lock).
// The caller drops an empty queue (um_events_drop_if_empty).
static inline void um_events_erase(UMStreamEvents& ev, um_event_queue& q, size_t i) noexcept {
    if (q[i].event != nullptr) {
        try { ev.to_release.push_back(q[i].event); } catch (...) {}
    }
    q.erase(q.begin() + i);
    ev.count--;
}

static inline void um_events_drop_if_empty(UMStreamEvents& ev, uintptr_t stream) noexcept {
    auto it = ev.queues.find(stream);
    if (it != ev.queues.end() && it->second.empty()) ev.queues.erase(it);
}

static inline int um_push_ask(std::vector<um_event_ask>& v, PyObject* event, uintptr_t stream, uint64_t seq) noexcept {
    try { v.push_back(um_event_ask{event, stream, seq}); return 0; } catch (...) { return -1; }
}

static inline int um_push_block(std::vector<void*>& v, void* p) noexcept {
    try { v.push_back(p); return 0; } catch (...) { return -1; }
}
