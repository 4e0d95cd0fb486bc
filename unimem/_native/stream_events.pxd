# The stream events the core waits for, as native data (stream_events.hpp).
from cpython.ref cimport PyObject
from libc.stdint cimport uint64_t, uintptr_t
from libcpp.deque cimport deque
from libcpp.map cimport map as cmap
from libcpp.vector cimport vector

cdef extern from "stream_events.hpp" nogil:
    cdef struct um_pending_event:
        PyObject* event
        void* block
        uint64_t seq
        bint taken
    ctypedef deque[um_pending_event] um_event_queue
    cdef struct um_event_ask:
        PyObject* event
        uintptr_t stream
        uint64_t seq
    cdef cppclass UMStreamEvents:
        cmap[uintptr_t, um_event_queue] queues
        size_t count
        uint64_t next_seq
        size_t known_done
        vector[um_event_ask] spare_asks
        vector[PyObject*] to_release
        vector[void*] recording
    int um_events_add(UMStreamEvents& ev, PyObject* event, void* block, uintptr_t stream)
    long um_events_index(um_event_queue& q, uint64_t seq)
    void um_events_erase(UMStreamEvents& ev, um_event_queue& q, size_t i)
    void um_events_drop_if_empty(UMStreamEvents& ev, uintptr_t stream)
    int um_push_ask(vector[um_event_ask]& v, PyObject* event, uintptr_t stream, uint64_t seq)
    int um_push_block(vector[void*]& v, void* p)
