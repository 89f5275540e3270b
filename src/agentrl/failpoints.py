"""Failpoints: named points where a test makes a process fail on purpose (the pattern of TiKV's ``fail-rs`` and
FoundationDB's buggify).

A failpoint is a call ``failpoint("area.operation.moment")`` placed in a crash window (between two writes that
recovery must cope with being cut apart). It is **inert unless enabled**: with ``AGENTRL_FAILPOINTS`` unset (the
only state in production) a call is one dictionary lookup and does nothing. A test enables points by setting the
variable before the process starts; it is read once, at the first call. Its value is a comma-separated list of
``name[=action][@n]``: the point fails the ``n``-th time this process reaches it (default: the first), with

- ``raise`` (default): the point raises ``FailpointHit`` (in-process tests: the caller then behaves as if it died
  there);
- ``exit``: the process ends at once with ``os._exit(86)``: no ``finally``, no cleanup, like SIGKILL;
- ``return``: the call returns ``True`` and the caller skips the operation it guards while reporting success, as
  ``fail-rs``'s ``return`` (a *silent* failure; only the "return" points below, ``RETURN_POINTS``, take it).

Points in the code:

- ``slots.claim.before_record`` (a slot claimed on its Task, its Record not inserted),
  ``slots.take_over.between_writes`` (an expired attempt retired, its successor not inserted),
  ``slots.finish.after_record`` (``SlotLeases.finish``: the Record is scored or failed, the slot is not yet settled
  on its Task), ``slots.finish.after_settle`` (settled, the lease not dropped, the group stage not claimed);
- ``sampler.sample.before_finish`` (a trajectory's Record ``completed``, not yet scored and settled);
- ``episode.create.before_record`` (an environment instance created, its id not recorded on the Record),
  ``episode.close.before_mark`` (the instance closed, the Record still says it is open);
- ``group_stage.after_credits`` (a per-turn estimator's advantages written on the calls, no Record moved),
  ``group_stage.after_ready`` (a kept trajectory's Record ``ready``, its samples not queued),
  ``group_stage.before_complete`` (every Record moved on, the Task not closed);
- ``images.before_files`` (an image's GridFS chunks written, its files document not);
- ``samples.claim.after_one`` (a trainer rank claimed one more sample of its step);
- ``publish.after_export`` (new weights written or sent, no service told), ``publish.before_bump`` (services
  loaded them, ``Run.policy_version`` not bumped), ``publish.distributed.after_first_bucket`` (the first bucket of
  an in-memory publish broadcast, the others not);
- ``engine.weight_update.after_receive`` (``agentrl engine``: a bucket of an in-memory update received, not staged);
- ``checkpoint.save.before_rename`` (a complete checkpoint under its temporary name), ``checkpoint.save.after_aside``
  (an older checkpoint of the same step renamed aside, the new one not in place), ``checkpoint.save.after_rename``
  (the new one in place, the old one not yet deleted), ``weights.replace.after_aside``/``after_rename`` (the same
  for exported weights);
- ``trainer.checkpoint.before_mark_trained`` (a checkpoint is complete, its steps' claims are not yet ``trained``),
  ``trainer.step.after_log`` (a step's update and ledger are written, the next step not started),
  ``trainer.skip.after_abandon`` (stale samples' Records ``abandoned``, the samples still claimed, not ``skipped``);
- "return" points of ``agentrl engine``: ``engine.update_weights.swap`` (a weight update reads the checkpoint and
  answers success with the new ``weight_version``, but the served weights stay as they were),
  ``engine.load_lora_adapter.apply`` (an adapter is listed as loaded under its name but changes no layer).
"""

from __future__ import annotations

import os

ENV = "AGENTRL_FAILPOINTS"
EXIT_CODE = 86
ACTIONS = ("raise", "exit", "return")
RETURN_POINTS = frozenset({"engine.update_weights.swap", "engine.load_lora_adapter.apply"})
"""The points whose caller skips an operation on ``return`` (any other point would ignore it)."""

_enabled: dict[str, tuple[str, int]] | None = None
_reached: dict[str, int] = {}


class FailpointHit(RuntimeError):
    """Raised by an enabled failpoint (a deliberate, test-only failure)."""


def _parse(spec: str) -> dict[str, tuple[str, int]]:
    points = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        head, _, count = item.partition("@")
        name, _, action = head.partition("=")
        action, count = action.strip() or "raise", count.strip() or "1"
        if action not in ACTIONS or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{ENV}: {item!r} is not name[=raise|exit|return][@n] with n >= 1")
        if action == "return" and name.strip() not in RETURN_POINTS:
            raise ValueError(f"{ENV}: {item!r}: only {', '.join(sorted(RETURN_POINTS))} take 'return'")
        points[name.strip()] = (action, int(count))
    return points


def failpoint(name: str) -> bool:
    """Fail here if ``name`` is enabled in ``AGENTRL_FAILPOINTS`` and reached for the chosen time; else nothing.
    Returns whether a ``return`` action fired (the caller then skips what the point guards)."""
    global _enabled
    if _enabled is None:
        _enabled = _parse(os.environ.get(ENV, ""))
    point = _enabled.get(name)
    if point is None:
        return False
    _reached[name] = _reached.get(name, 0) + 1
    action, count = point
    if _reached[name] != count:
        return False
    if action == "exit":
        os._exit(EXIT_CODE)
    if action == "return":
        return True
    raise FailpointHit(f"failpoint {name} hit ({ENV})")


def reset() -> None:
    """Read ``AGENTRL_FAILPOINTS`` again at the next call and forget how often points were reached (for tests that
    change it in-process)."""
    global _enabled
    _enabled = None
    _reached.clear()
