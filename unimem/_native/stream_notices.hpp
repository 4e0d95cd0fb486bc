// What the core tells a backend about its streams: that it names one
// (check_stream, at record_stream) and that it keeps nothing for one any
// more (release_stream). Both calls run with the core's lock let go, so two
// threads may tell about one stream at once, in either order. One thread
// at a time is a stream's teller (it has an entry in ``telling``); once its
// call returns it compares, under the lock, what it told with the core's
// table and tells again until they agree. Every field is read and changed
// with the core's lock held.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

enum : uint8_t {
    UM_TOLD_RELEASE = 1,    // the last call told about the stream was its release
    UM_TOLD_UNKNOWN = 2,    // another thread told about it meanwhile: tell again what the table says
};

struct UMStreamNotices {
    std::vector<uintptr_t> dropped;         // streams whose pools went: their release is to be told
    std::map<uintptr_t, uint8_t> telling;   // stream -> UM_TOLD_* of its teller's last call
    uint64_t releases_told = 0;             // rounds of releases told so far
    bool added = false;                     // a stream came in: ask which others are abandoned
};

// 0, or -1 when host memory ran out (nothing changed then).
static inline int um_notices_tell(UMStreamNotices& n, uintptr_t stream, uint8_t told) noexcept {
    try {
        n.telling[stream] = told;
    } catch (...) {
        return -1;
    }
    return 0;
}

static inline int um_notices_drop(UMStreamNotices& n, uintptr_t stream) noexcept {
    try {
        n.dropped.push_back(stream);
    } catch (...) {
        return -1;
    }
    return 0;
}
