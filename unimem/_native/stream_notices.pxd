# What the core tells a backend about its streams (stream_notices.hpp).
from libc.stdint cimport uint8_t, uint64_t, uintptr_t
from libcpp.map cimport map as cmap
from libcpp.vector cimport vector

cdef extern from "stream_notices.hpp" nogil:
    uint8_t UM_TOLD_RELEASE
    uint8_t UM_TOLD_UNKNOWN
    cdef cppclass UMStreamNotices:
        vector[uintptr_t] dropped
        cmap[uintptr_t, uint8_t] telling
        uint64_t releases_told
        bint added
    int um_notices_tell(UMStreamNotices& n, uintptr_t stream, uint8_t told)
    int um_notices_drop(UMStreamNotices& n, uintptr_t stream)
