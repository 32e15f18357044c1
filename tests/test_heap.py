"""eyas.engine.heap: start-up's garbage is collected and what lives is frozen; EYAS_GC_FREEZE=0 leaves the heap as
it is."""
import gc

from eyas.engine.heap import freeze_heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_freeze_heap_collects_then_freezes(monkeypatch):
    import weakref
    monkeypatch.delenv("EYAS_GC_FREEZE", raising=False)
    gc.unfreeze()
    try:
        kept, dropped = _Cycle(), _Cycle()
        gone = weakref.ref(dropped)
        del dropped  # a cycle: only a collection frees it
        assert gone() is not None
        n = freeze_heap("test")
        assert gone() is None  # collected before the freeze, not frozen as garbage forever
        assert n == gc.get_freeze_count() > 1000
        assert not any(o is kept for o in gc.get_objects(generation=2))  # kept is in the permanent generation now
    finally:
        gc.unfreeze()


def test_freeze_heap_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("EYAS_GC_FREEZE", "0")
    gc.unfreeze()
    assert freeze_heap("test") == 0 and gc.get_freeze_count() == 0
