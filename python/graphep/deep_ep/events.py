"""EventOverlap: DeepEP's event wrapper, over a torch.cuda.Event (PyTorch imported on use)."""

from typing import Any, Optional, Tuple

from graphep.errors import invalid_argument


class EventOverlap:
    """A CUDA event an asynchronous call recorded (async_finish=True), or none.

    event: the torch.cuda.Event, or None (the call was synchronous: the current stream already
    waits for it). extra_tensors: tensors kept alive with the event (DeepEP's stand-in for
    record_stream under CUDA graphs).

        with buffer.dispatch(..., async_finish=True)[-1]:
            ...work on the current stream that overlaps the dispatch...
        # leaving the block, the current stream waits for the event
    """

    def __init__(self, event=None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """torch.cuda.current_stream() waits for the event."""
        if self.event is None:
            raise invalid_argument("EventOverlap.current_stream_wait: there is no event (the call ran with "
                                   "async_finish=False, so the current stream already waits for it)")
        import torch

        torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()
