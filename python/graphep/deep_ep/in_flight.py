"""Two operations in flight per engine shape, as DeepEP's double buffering allows.

DeepEP's buffers let a second micro-batch's dispatch start before the first one's combine (vLLM's
dual-batch overlap, SGLang's two-batch overlap: normal mode in prefill, low-latency mode in decode,
where a send half may also wait for its receive hook). A graphep engine holds one operation: it
combines its last dispatch, and between a send half and its hook it takes nothing else. So a
Buffer keeps up to two engines per shape, the first made as before and the second on the first
dispatch that finds the first one held, and chooses per dispatch (pick_engine). The choice
depends only on the calls made, so every rank, making the same calls in the same order as DeepEP
requires, picks the same engine. A handle carries its engine: its combine and hooks act on it.
"""

from typing import Callable, Dict, List, Optional, Tuple


class InFlight:
    """What an engine of a Buffer holds, as pick_engine reads it."""

    def __init__(self) -> None:
        self.seq = 0  # the Buffer's number (Buffer._dispatch_seq) of this engine's last dispatch; 0: none
        self.combined = True  # its last dispatch was combined (or there was none)
        # (what, token) while a send half waits for its receive hook (low-latency mode only).
        self.pending: Optional[tuple] = None
        self.second: Optional["InFlight"] = None  # the shape's second engine, on the first engine only

    def engines(self) -> List["InFlight"]:
        """The shape's engines: this first one, and its second once made."""
        return [self] if self.second is None else [self, self.second]


def pick_engine(states: List[InFlight], routes_it: Optional[Callable[[InFlight], bool]] = None) -> Optional[InFlight]:
    """The engine of a shape that its next dispatch runs on, among the shape's engines `states`
    (first made first), as DeepEP's two buffers alternate: the first free one (its last dispatch
    combined, or none yet, and no receive hook waiting); else, given routes_it, the first with no
    hook waiting whose last dispatch routed the same tokens (the normal mode's re-dispatch: its
    handle stays served, so it needs no second engine); else, with two engines, the one whose
    last dispatch is older among those with no hook waiting (that dispatch's handle goes stale).
    None: one engine, held (the caller makes the second), or two, each holding a send half until
    its hook (refused)."""
    for st in states:
        if st.pending is None and st.combined:
            return st
    if routes_it is not None:
        for st in states:
            if st.pending is None and routes_it(st):
                return st
    if len(states) < 2:
        return None
    oldest = None  # plain loops: this runs ahead of every low-latency dispatch's launch
    for st in states:
        if st.pending is None and (oldest is None or st.seq < oldest.seq):
            oldest = st
    return oldest


def engine_for_dispatch(first: InFlight, make_second: Callable[[], InFlight],
                        routes_it: Optional[Callable[[InFlight], bool]] = None) -> Optional[InFlight]:
    """pick_engine over first's shape, the shape's second engine made (make_second) and taken when
    the first is held and there is none yet. None: both engines hold a send half (refused)."""
    st = pick_engine(first.engines(), routes_it)
    if st is None and first.second is None:
        st = first.second = make_second()
    return st


def statuses(engines: Dict[Tuple[int, ...], InFlight], status: Callable[[InFlight], object]) -> Dict[Tuple[int, ...], object]:
    """status(engine) of every engine, by its shape's key; a shape's second engine by key + (1,)."""
    out = {}
    for key, st in engines.items():
        out[key] = status(st)
        if st.second is not None:
            out[key + (1,)] = status(st.second)
    return out
