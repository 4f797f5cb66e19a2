"""finetune.hooks: the named test seams. A fire runs the callbacks registered for its point, in order, with its
keyword arguments; a point nothing registered for does nothing; clear forgets them all."""

from __future__ import annotations

from finetune import hooks


def test_fire_runs_the_callbacks_of_its_point_in_order_and_clear_forgets_them() -> None:
    calls: list[tuple[str, dict]] = []
    hooks.register("after_step", lambda **kw: calls.append(("first", kw)))
    hooks.register("after_step", lambda **kw: calls.append(("second", kw)))
    hooks.register("checkpoint_written", lambda **kw: calls.append(("other", kw)))
    hooks.fire("after_step", step=3)
    hooks.fire("nothing_registered", step=4)
    assert calls == [("first", {"step": 3}), ("second", {"step": 3})]
    hooks.clear()
    hooks.fire("after_step", step=5)
    hooks.fire("checkpoint_written", path="x")
    assert len(calls) == 2
