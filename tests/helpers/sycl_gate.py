"""Work that keeps a SYCL queue busy until a test lets it finish: a kernel
spinning on a flag in shared USM (the XPU tests, on the OpenCL CPU device)."""
import ctypes

SPIN = """
__kernel void spin(__global volatile int* gate) {
    while (gate[0] == 0) { }
}
"""


class Gate:
    """Work on a queue that stays pending until the test opens the gate. Its
    flag lives on ``flag_queue`` (``queue`` by default): a gate that must not
    keep ``queue`` alive puts it on another."""

    def __init__(self, dpctl, queue, flag_queue=None):
        import dpctl.memory as dpm
        import dpctl.program as dpp
        self.flag = dpm.MemoryUSMShared(8, queue=flag_queue or queue)
        self.flag.copy_from_host(bytearray(8))
        kernel = dpp.create_program_from_source(queue, SPIN).get_sycl_kernel("spin")
        self.event = queue.submit_async(kernel, [self.flag], [1])

    def open(self):
        ctypes.c_int.from_address(self.flag._pointer).value = 1
        self.event.wait()
