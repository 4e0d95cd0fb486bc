"""What the core's tests of stream-ordered frees share: blocks freed after
use on a stream (each waits for its event), and a device whose event query
runs a finalizer that allocates."""
from unimem.backends.simulated import SimulatedGPU


def free_after_use(a, blocks, stream):
    """Free ``blocks`` used on ``stream``: an event each, pending."""
    for p in blocks:
        a.record_stream(p, stream)
        a.free(p)


class AllocatesInAQuery(SimulatedGPU):
    """event_done runs ``hook`` once first: a finalizer that allocates,
    run by a garbage collection inside the query."""
    hook = None

    def event_done(self, event):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return super().event_done(event)
